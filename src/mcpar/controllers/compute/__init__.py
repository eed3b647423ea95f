"""ComputeController: the schedule of a step and everything that decides it.

- ``controller.py``: the step as a list of tasks, run in order, with a task log;
- ``pipeline_schedules.py``: the registered pipeline schedules (GPipe, 1F1B, interleaved 1F1B);
- ``schedules.py``: a schedule's actions as the step's task list;
- ``stage_cut.py``: how the model is cut into pipeline stages (by modelled cost);
- ``batch_split.py``: how many micro-batches a step is cut into (fixed, or measured: dynamic);
- ``load_balance.py`` / ``expert_balance.py``: the expert load-balancing policy (static, greedy,
  reinforcement) and the MoE side of a step (router bias, measured costs, expert migration);
  ``placement_agent.py``: the learning policy; ``balance_math.py``: rank loads and the swap
  planner (the bench's ``bench/routing_traces.py`` holds the traces the policies are tried on).
"""
