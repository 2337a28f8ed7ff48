import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# cuBLAS reads this when it starts, before any test runs a CUDA product: its deterministic
# workspaces make tests/test_cuda.py's bitwise comparisons with eager meaningful.  It changes
# nothing on a machine without CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def verify_every_export(monkeypatch):
    """Every program a test exports keeps the IR contract that `load` checks
    (predispatch/serialize/verify.py), so export and load cannot drift apart."""
    import predispatch._export as export_module
    from predispatch.serialize.verify import verifying

    monkeypatch.setattr(export_module, "_export_with_policy", verifying(export_module._export_with_policy))
