"""Keys predispatch writes into `fx.Node.meta`, shared by the stage that writes and the one that reads."""

#: On `_set_grad_enabled` nodes: "enter" (opens a region) or "exit" (closes one).
#: Written by the trace (trace/grad_history.py), read by passes/wrap_regions.py.
GRAD_TOGGLE = "predispatch_grad_toggle"

#: On nodes a torch.func transform computed, traced below autograd: the transform's name.
#: Written by trace/transforms.py, read by the trace's engagement check (trace/functional.py).
BELOW_AUTOGRAD = "predispatch_below_autograd"
