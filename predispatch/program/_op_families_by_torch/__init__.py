"""The generated allow-list tables, one per tested torch release (`torch_<major>_<minor>.py`).

Each is written by `python -m predispatch.program.op_allowlist --write` on its torch; torch adds,
drops and re-tags ops between releases, so one table cannot decide them all.
"""
