"""Command line: ``python -m mixedad demo``, ``python -m mixedad profile`` and ``python -m mixedad plan``."""
import argparse
import pathlib
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

import torch

__all__ = ["main", "build_parser", "run_profile", "run_plan", "DTYPES", "DEMO_DTYPES", "PLAN_DTYPES",
           "PROFILE_DEFAULTS"]

DTYPES: Dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
#: the demo also runs in half precision, which mixedad handles; profiling stays in float32/64
DEMO_DTYPES: Dict[str, torch.dtype] = {**DTYPES, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: memory plans are for GPU dtypes
PLAN_DTYPES: Dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2 (no usage dump, no traceback)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m mixedad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    demo = sub.add_parser("demo", help="mixed_grad vs double backward on a deep random generator")
    demo.add_argument("--model", choices=["mlp", "dcgan"], default="mlp")
    demo.add_argument("--depth", type=int, default=64,
                      help="Linear layers (mlp) or extra conv blocks per stage (dcgan)")
    demo.add_argument("--width", type=int, default=512, help="hidden width (mlp) or latent size (dcgan)")
    demo.add_argument("--batch", type=int, default=256)
    demo.add_argument("--dtype", choices=sorted(DEMO_DTYPES), default="float64")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--repeats", type=int, default=3, help="timing repeats (median)")

    from mixedad.benchmark import DEFAULT_STRATEGIES, MODELS, STRATEGIES

    prof = sub.add_parser("profile", help="time and peak memory of mixed_grad and alternatives against depth")
    prof.add_argument("--model", choices=sorted(MODELS), default="mlp")
    prof.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    prof.add_argument("--width", type=int, default=None,
                      help=f"hidden width or channels (default per model: {PROFILE_DEFAULTS})")
    prof.add_argument("--batch", type=int, default=None, help="batch size (default per model, as above)")
    prof.add_argument("--device", default="cpu")
    prof.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    prof.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(DEFAULT_STRATEGIES))
    prof.add_argument("--repeats", type=int, default=5, help="timing repeats (median)")
    prof.add_argument("--out", default="profile-results", help="folder for the JSON, markdown and PNG")
    prof.add_argument("--trace", action="store_true",
                      help="also export a torch.profiler trace of each strategy at the largest depth")

    from mixedad.profiling import PLAN_METHODS, plan_models

    plan = sub.add_parser("plan", help="predicted peak memory on a GPU, from one run on meta tensors (no GPU needed)")
    plan.add_argument("--model", choices=plan_models(), required=True)
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--resolution", type=int, default=1024, help="image side, or sequence length for gpt2-medium")
    plan.add_argument("--dtype", choices=sorted(PLAN_DTYPES), default="float16")
    plan.add_argument("--gpu-gib", type=float, default=80.0, help="memory of the card to check against (GiB)")
    plan.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="whose kernel choices to emulate")
    plan.add_argument("--methods", nargs="+", choices=list(PLAN_METHODS),
                      default=["forward", "mixed_grad", "double_backward"])
    return parser


#: model -> (width, batch) used when --width / --batch are not given
PROFILE_DEFAULTS: Dict[str, Tuple[int, int]] = {"mlp": (512, 256), "dcgan": (32, 32), "resnet": (32, 32),
                                                "transformer": (64, 32), "stylegan2_ada": (32, 8),
                                                "vq_decoder": (32, 8)}


def _check_device(command, device):
    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        raise SystemExit(f"python -m mixedad {command}: --device {device!r} is not a device ({error}).") from error
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"python -m mixedad {command}: --device {device}, but no CUDA device is available.")


def _check_out(command, out):
    """Refuse an --out that cannot take the results before the sweep runs, not after."""
    path = pathlib.Path(out)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"python -m mixedad {command}: --out {out} exists and is not a folder.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".mixedad-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise SystemExit(f"python -m mixedad {command}: cannot write to --out {out} ({error.strerror}).") from error


def run_profile(args: argparse.Namespace) -> List[Dict[str, Any]]:
    from mixedad import benchmark

    _check_device("profile", args.device)
    _check_out("profile", args.out)
    width = args.width or PROFILE_DEFAULTS[args.model][0]
    batch = args.batch or PROFILE_DEFAULTS[args.model][1]
    for name, value in (("width", width), ("batch", batch), ("repeats", args.repeats), *(("depths", d) for d in args.depths)):
        if value < (0 if name == "depths" and args.model != "mlp" else 1):
            raise SystemExit(f"python -m mixedad profile: --{name} must be positive, got {value}.")
    rows = benchmark.profile(args.model, args.depths, width=width, batch=batch, dtype=DTYPES[args.dtype],
                             device=args.device, strategies=args.strategies, repeats=args.repeats,
                             trace_dir=args.out if args.trace else None)
    device_name = torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda" else "CPU"
    title = (f"{args.model}, width {width}, batch {batch}, {args.dtype}, {device_name}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    stem = f"{args.model}_{torch.device(args.device).type}"
    for path in benchmark.write(rows, args.out, stem, title):
        print(f"wrote {path}")
    print(benchmark.markdown(rows))
    return rows


def _plan_error(message):
    print(f"python -m mixedad plan: error: {message}", file=sys.stderr)
    return SystemExit(2)


def run_plan(args: argparse.Namespace) -> Any:
    """Build ``args.model`` on meta at its size, plan it, print the table and what fits in ``--gpu-gib``."""
    from mixedad.profiling import PlanError, plan_model

    for name in ("batch", "resolution"):
        if getattr(args, name) < 1:
            raise _plan_error(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    if not args.gpu_gib > 0:
        raise _plan_error(f"--gpu-gib must be positive, got {args.gpu_gib}.")
    try:
        result, what = plan_model(args.model, batch=args.batch, resolution=args.resolution,
                                  dtype=PLAN_DTYPES[args.dtype], device=args.device, methods=args.methods)
    except ModuleNotFoundError as error:
        raise _plan_error(f"--model {args.model}: {error}.") from None
    except ValueError as error:  # a size the model cannot be built at (each model says which sizes it takes)
        first = str(error).strip().splitlines()[0] if str(error).strip() else "cannot be built at this size"
        raise _plan_error(f"--model {args.model} --resolution {args.resolution}: {first}") from None
    except PlanError as error:
        raise _plan_error(str(error)) from None
    print(f"{what}, batch {args.batch}, {args.dtype}, {args.device} kernels")
    print(result)
    fits = result.fits(args.gpu_gib)
    print(f"fits in {args.gpu_gib:g} GiB: " + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in fits.items()))
    print(f"planned in {sum(result.seconds.values()):.1f} s")
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from mixedad.demo import run_demo

        for name in ("depth", "width", "batch", "repeats"):
            if getattr(args, name) < 1:
                raise SystemExit(f"python -m mixedad demo: --{name} must be >= 1, got {getattr(args, name)}.")
        _check_device("demo", args.device)
        run_demo(model=args.model, depth=args.depth, width=args.width, batch=args.batch,
                 dtype=DEMO_DTYPES[args.dtype], device=args.device, repeats=args.repeats)
    elif args.command == "profile":
        run_profile(args)
    elif args.command == "plan":
        run_plan(args)
    return 0
