"""Which hooks were traced into a program, so later changes can be detected.

Forward hooks and pre-hooks (module and global) run during the trace and are part of the
graph; if a hook is added or removed afterwards, the program no longer behaves like the
module.  `record_hooks` snapshots them at export (by module path, kind, and the hook's
qualified name); `hook_changes` lists what differs, for `ExportedProgram.verify_hooks`
(torch.compile's `skip_nnmodule_hook_guards=False`, on request).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.modules import module as module_globals

#: Module attributes holding hooks, with the kind name we report.
HOOK_KINDS = {
    "_forward_pre_hooks": "forward_pre_hook",
    "_forward_hooks": "forward_hook",
    "_backward_pre_hooks": "backward_pre_hook",
    "_backward_hooks": "backward_hook",
    "_state_dict_pre_hooks": "state_dict_pre_hook",
    "_state_dict_hooks": "state_dict_hook",
    "_load_state_dict_pre_hooks": "load_state_dict_pre_hook",
    "_load_state_dict_post_hooks": "load_state_dict_post_hook",
}

_GLOBAL_KINDS = {
    "_global_forward_pre_hooks": "global forward_pre_hook",
    "_global_forward_hooks": "global forward_hook",
    "_global_backward_pre_hooks": "global backward_pre_hook",
    "_global_backward_hooks": "global backward_hook",
}


@dataclass(frozen=True)
class HookEntry:
    """One registered hook: where (module path, '' for the root or global), what kind, which function."""

    module: str
    kind: str
    handle_id: int
    function: str


@dataclass(frozen=True)
class HookRecord:
    """All hooks of a module tree and the global module hooks, at one moment."""

    entries: frozenset[HookEntry]

    @property
    def has_state_dict_hooks(self) -> bool:
        return any("state_dict" in e.kind for e in self.entries)


def record_hooks(root: nn.Module) -> HookRecord:
    entries = set()
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, kind in HOOK_KINDS.items():
            for handle_id, hook in getattr(module, attr, {}).items():
                entries.add(HookEntry(path, kind, handle_id, _qualname(hook)))
    for attr, kind in _GLOBAL_KINDS.items():
        for handle_id, hook in getattr(module_globals, attr, {}).items():
            entries.add(HookEntry("", kind, handle_id, _qualname(hook)))
    return HookRecord(frozenset(entries))


def hook_changes(before: HookRecord, after: HookRecord) -> list[str]:
    """Human-readable differences, sorted: `added forward_hook on 'lin': mymod.log_output`."""
    def line(verb: str, e: HookEntry) -> str:
        where = f"on {e.module!r}" if e.module else "on the root" if "global" not in e.kind else ""
        return f"{verb} {e.kind} {where}: {e.function}".replace("  ", " ")

    added = [line("added", e) for e in after.entries - before.entries]
    removed = [line("removed", e) for e in before.entries - after.entries]
    return sorted(added + removed)


def _qualname(hook: object) -> str:
    fn = getattr(hook, "__func__", hook)
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
