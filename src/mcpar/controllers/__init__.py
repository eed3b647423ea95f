"""The three MCP controllers: compute (schedule), memory (placement), communication (wire)."""
