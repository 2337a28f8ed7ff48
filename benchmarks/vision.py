"""Export time of a zoo of timm vision models: `predispatch.export` against `torch.export`.

    python benchmarks/vision.py [--reps 3] [--size 64] [--models resnet18 vit_tiny_patch16_224 ...]
                                [--modes eval train] [--out benchmarks/vision_results.md]

Each model (random weights, `pretrained=False`, one `(2, 3, size, size)` input; transformers are
built for that image size) is exported in eval and in train mode by `predispatch.export` and by
`torch.export.export(strict=False)`, one untimed warm-up each, then `--reps` rounds with the two
tools alternated (benchmarks/run.py's `time_exports`), so load from other processes falls on both
alike. Reports the per-model ratio pd / torch.export, its median and its worst against the
targets (`TARGETS`: the whole zoo issue 15's, `--models twelve` issue 25's), and checks each predispatch program against eager on the input
(eval: the outputs; train: the outputs with the same seed, for dropout and drop-path).

timm is imported as tests/timm_support.py does (no torchvision here, see ../shared/ECOSYSTEM.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import predispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import run  # noqa: E402  (a sibling file, not a package)
from run import _fmt, _verdict, time_exports  # noqa: E402
from timm_support import import_timm  # noqa: E402

#: (timm name, whether it takes `img_size=`): one or two small members of each family that loads
#: without torchvision.
ZOO: list[tuple[str, bool]] = [
    ("resnet18", False),
    ("resnet50", False),
    ("resnext26ts", False),
    ("seresnext26d_32x4d", False),
    ("regnetx_002", False),
    ("regnety_002", False),
    ("densenet121", False),
    ("efficientnet_b0", False),
    ("mobilenetv2_035", False),
    ("mobilenetv3_small_050", False),
    ("mnasnet_050", False),
    ("ghostnet_050", False),
    ("rexnet_100", False),
    ("dla34", False),
    ("dpn48b", False),
    ("hrnet_w18_small", False),
    ("vgg11", False),
    ("inception_v3", False),
    ("convnext_atto", False),
    ("convnextv2_atto", False),
    ("mobilevit_xxs", False),
    ("repvgg_a0", False),
    ("cspresnet50", False),
    ("darknet17", False),
    ("res2net50_14w_8s", False),
    ("vit_tiny_patch16_224", True),
    ("deit_tiny_patch16_224", True),
    ("beit_base_patch16_224", True),
    ("swin_tiny_patch4_window7_224", True),
    ("levit_128s", False),
    ("poolformer_s12", False),
    ("coat_lite_tiny", False),
    ("pit_ti_224", True),
    ("mixer_b16_224", True),
    ("resmlp_12_224", True),
    ("cait_xxs24_224", True),
    ("xcit_nano_12_p16_224", True),
    ("crossvit_tiny_240", False),
    ("efficientformer_l1", False),
    ("edgenext_xx_small", False),
    ("maxvit_nano_rw_256", True),
    ("twins_svt_small", False),
    ("eva02_tiny_patch14_224", True),
]
#: Models whose architecture fixes the input size (224, or 240/256 for their own defaults).
NATIVE_SIZE = {"levit_128s": 224, "coat_lite_tiny": 224, "crossvit_tiny_240": 240, "efficientformer_l1": 224,
               "twins_svt_small": 224, "maxvit_nano_rw_256": 64, "inception_v3": 96, "swin_tiny_patch4_window7_224": 224,
               "eva02_tiny_patch14_224": 56, "pit_ti_224": 64, "mixer_b16_224": 64, "cait_xxs24_224": 64}


#: Issue 25's twelve models (`--models twelve`): the families timm and torchvision share.
TWELVE = ["resnet18", "resnet50", "densenet121", "efficientnet_b0", "mobilenetv2_035", "mobilenetv3_small_050",
          "regnetx_002", "inception_v3", "vgg11", "convnext_atto", "vit_tiny_patch16_224", "swin_tiny_patch4_window7_224"]

#: (median, worst) ratio targets: issue 15's for the whole zoo, issue 25's for the twelve.
TARGETS = {"zoo": (0.9, 1.3), "twelve": (0.85, 1.1)}


def build(timm, name: str, takes_size: bool, size: int, mode: str) -> tuple[torch.nn.Module, tuple]:
    """The model with random weights in `mode`, and one input batch."""
    size = NATIVE_SIZE.get(name, size)
    torch.manual_seed(0)
    extra = {"img_size": size} if takes_size and name not in ("swin_tiny_patch4_window7_224",) else {}
    model = timm.create_model(name, pretrained=False, **extra)
    model.train(mode == "train")
    return model, (torch.randn(2, 3, size, size),)


def equal_to_eager(model: torch.nn.Module, args: tuple, mode: str) -> str:
    """'yes' if predispatch's program gives eager's outputs on `args` (same seed), else why not."""
    try:
        ep = predispatch.export(model, args)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(1)
        with torch.no_grad():
            got = ep.module()(*args)
        model.load_state_dict(state)  # undo the program's BatchNorm statistics update
        torch.manual_seed(1)
        with torch.no_grad():
            expected = model(*args)
        model.load_state_dict(state)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        return "yes"
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"no: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:100]}"


def run_zoo(reps: int, size: int = 64, models: list[str] | None = None, modes: tuple[str, ...] = ("eval", "train")) -> tuple[list[str], float | None, tuple[float, str] | None]:
    """Time and check every (model, mode) of the zoo: the markdown table with its summary line,
    the median ratio pd / torch.export and the worst (ratio, "model mode")."""
    timm = import_timm()
    zoo = [(n, s) for n, s in ZOO if not models or n in models]
    lines = [
        f"`python benchmarks/vision.py --reps {reps} --size {size}{'' if run.CLOCK is run.CLOCKS['wall'] else ' --clock cpu'}`: timm {timm.__version__}, torch "
        f"{torch.__version__}, torch threads {torch.get_num_threads()}; medians of {reps} warm exports, tools alternated.",
        "",
        "| model | mode | predispatch s | torch.export s | pd / torch.export | pd nodes | torch.export nodes | equal to eager |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    ratios = []
    for name, takes_size in zoo:
        for mode in modes:
            try:
                model, args = build(timm, name, takes_size, size, mode)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name} {mode}: cannot build: {exc}", file=sys.stderr, flush=True)
                continue
            times = time_exports(name, model, args, {}, reps, ["predispatch", "torch.export"])
            ratio = times.ratio("predispatch", "torch.export")
            if ratio is not None:
                ratios.append((ratio, f"{name} {mode}"))
            equal = equal_to_eager(model, args, mode) if "predispatch" in times.seconds else "export failed"
            row = (f"| {name} | {mode} | {_fmt(times.seconds.get('predispatch'), '.3f')} "
                   f"| {_fmt(times.seconds.get('torch.export'), '.3f')} | {_fmt(ratio, '.2f')}x "
                   f"| {times.nodes.get('predispatch', '-')} | {times.nodes.get('torch.export', '-')} | {equal} |")
            lines.append(row)
            print(row, *[f"  {t}: {e}" for t, e in times.errors.items()], file=sys.stderr, flush=True)
    median = statistics.median(r for r, _ in ratios) if ratios else None
    worst = max(ratios) if ratios else None
    targets = "twelve" if models and sorted(models) == sorted(TWELVE) else "zoo"
    lines += ["", summary(len(ratios), median, worst, min(ratios)[0] if ratios else None, targets)]
    return lines, median, worst


def summary(exports: int, median: float | None, worst: tuple[float, str] | None, best: float | None, targets: str = "zoo") -> str:
    """The one-line verdict against the targets of `targets` (a `TARGETS` key)."""
    most, worst_most = TARGETS[targets]
    return (
        f"{exports} exports: median pd / torch.export **{_fmt(median, '.2f')}x** (target <= {most}x: "
        f"**{_verdict(median, most)}**), worst **{_fmt(worst and worst[0], '.2f')}x** ({worst and worst[1]}; target "
        f"<= {worst_most}x: **{_verdict(worst and worst[0], worst_most)}**), best {_fmt(best, '.2f')}x."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", type=int, default=64, help="image side for models that take any size")
    parser.add_argument("--models", nargs="*", help="only these timm names, or `twelve` for issue 25's (default: the whole zoo)")
    parser.add_argument("--modes", nargs="*", default=["eval", "train"], choices=["eval", "train"])
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    parser.add_argument("--clock", choices=sorted(run.CLOCKS), default="wall", help="cpu: the process's CPU time (see run.CLOCKS)")
    opts = parser.parse_args()
    run.CLOCK = run.CLOCKS[opts.clock]
    models = TWELVE if opts.models == ["twelve"] else opts.models
    lines, _, _ = run_zoo(opts.reps, opts.size, models, tuple(opts.modes))
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        opts.out.write_text(text)


if __name__ == "__main__":
    main()
