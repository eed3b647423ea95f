"""Collective algorithms and compression codecs the CommunicationController runs."""
