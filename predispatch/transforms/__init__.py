"""Transforms: new programs made from an exported one.

`joint.py`: `ep.joint()`, the functional joint forward-backward program.  `to_torch.py`:
`ep.to_torch()` / `to_torch_forward_backward()`, torch.export's `ExportedProgram`, with its
lowering passes: `recompose_for_torch.py` (torch's training-IR batch norm and dropout, and
copies of the statistics where that form cannot be used), `flatten_function_outputs.py`
(custom Functions in the form `torch.export.load` reads),
`lower_for_inference.py` (forward-only consumers), `lower_batch_norm_stats.py` (ExecuTorch).
"""

from predispatch.transforms.joint import joint_program
from predispatch.transforms.to_torch import to_torch, to_torch_forward_backward

__all__ = ["joint_program", "to_torch", "to_torch_forward_backward"]
