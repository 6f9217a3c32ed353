#!/usr/bin/env python
"""Load sdplan's outputs on the previous major transformers (4.x, with the diffusers that pairs with it) and on
this environment's, and check that both see the same thing.

diffusers >= 0.36 needs huggingface_hub 1.x and transformers 4.x needs huggingface_hub < 1, so a user on
transformers 4 has an older diffusers too (kohya sd-scripts and many UIs pin such a stack). This script:

1. trains tiny outputs on the CPU with this environment: the demo LoRA of every family (with its base model),
   DreamBooth folders of SD 1.x and SDXL with and without the text encoders, full fine-tune folders of SD3.5
   and FLUX.1, and textual-inversion embeddings;
2. builds a second environment (``--venv``, kept for the next run) that shares this one's packages but pins
   the older stack (``OLDER_STACK``, from PyPI: the only network it needs);
3. loads every output in both (``DiffusionPipeline.from_pretrained``, ``load_lora_weights`` of the
   diffusers and the kohya-format LoRA, ``load_textual_inversion``), and compares parameter counts and sums, every tokenizer's ids for a prompt, the
   first text encoder's output and a 2-step image.

Prints one line per output and exits 1 if any differs or fails to load. Not part of `make test` (it installs
packages); the structural checks of tests/test_export_compat.py run there. Usage:
``python scripts/check_older_stack.py [--work DIR] [--venv DIR] [--train-with older]`` (``older``: the outputs
are trained by sdplan running on the older stack, which checks that sdplan runs there too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

OLDER_STACK = ("transformers==4.57.6", "tokenizers==0.22.2", "huggingface-hub==0.36.2", "diffusers==0.35.2")
FAMILIES = ("sd15", "sdxl", "sd35", "flux")  # each one's demo LoRA, base model and dataset come first
TE = "training.train_text_encoder=true"
# the other runs, on a family's demo model and dataset: name -> (family, method, extra overrides)
RUNS = {
    **{f"{f}-dreambooth": (f, "dreambooth", ()) for f in ("sd15", "sdxl")},
    **{f"{f}-dreambooth-te": (f, "dreambooth", (TE,)) for f in ("sd15", "sdxl")},
    **{f"{f}-ti": (f, "textual-inversion", ()) for f in ("sd15", "sdxl")},
    **{f"{f}-finetune": (f, "finetune", ()) for f in ("sd35", "flux")},
}
PROMPT = "a photo of <sks> person"
ROOT = Path(__file__).resolve().parents[1]


def fingerprint(work: Path) -> dict:
    """What this interpreter's transformers / diffusers load from each output under ``work``."""
    import warnings

    import diffusers
    import torch
    import transformers
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    warnings.filterwarnings("ignore")
    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()

    def describe(pipe) -> dict:
        d = {}
        for name, part in pipe.components.items():
            if hasattr(part, "state_dict"):
                sd = part.state_dict()
                total = sum(float(v.double().sum()) for v in sd.values() if v.is_floating_point())
                d[name] = [len(sd), round(total, 5)]
            elif name.startswith("tokenizer") and part is not None:
                d[name] = part(PROMPT).input_ids
        ids = pipe.tokenizer(PROMPT, padding="max_length", truncation=True, return_tensors="pt").input_ids
        # the flow-matching pipelines (SD3.5 / FLUX.1) at guidance 1: no unconditional pass
        call = {"guidance_scale": 1.0} if getattr(pipe, "transformer", None) is not None else {}
        with torch.no_grad():
            d["text_encoder_output"] = round(float(pipe.text_encoder(ids)[0].double().sum()), 4)
            image = pipe(
                PROMPT, num_inference_steps=2, height=64, width=64, output_type="np",
                generator=torch.Generator().manual_seed(0), **call,
            ).images[0]  # fmt: skip
        d["image_mean"] = round(float(image.mean()), 5)
        return d

    def base(family: str):
        return DiffusionPipeline.from_pretrained(work / f"{family}-lora" / "base_model")

    def lora(family: str, file: str | None = None):
        pipe, folder = base(family), work / f"{family}-lora"
        pipe.load_lora_weights(folder / file if file else folder)
        return describe(pipe)

    def embedding(name: str, family: str):
        pipe, path = base(family), work / name / f"{name}.safetensors"
        if family == "sd15":
            pipe.load_textual_inversion(path, token="<sks>")
        else:  # SDXL: one vector set per encoder (diffusers' documented way)
            state = load_file(path)
            pipe.load_textual_inversion(
                state["clip_l"], token="<sks>", text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer
            )
            pipe.load_textual_inversion(
                state["clip_g"], token="<sks>", text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2
            )
        return describe(pipe)

    loaders = {}
    for name, (family, method, _) in RUNS.items():
        if method == "textual-inversion":
            loaders[name] = lambda n=name, f=family: embedding(n, f)
        else:  # a diffusers folder
            loaders[name] = lambda n=name: describe(DiffusionPipeline.from_pretrained(work / n / "model"))
    for family in FAMILIES:
        loaders[f"{family}-lora"] = lambda f=family: lora(f)
        # the kohya-format file (A1111 / ComfyUI) through diffusers' converter; diffusers reads no kohya-format
        # SD3 LoRA, and its kohya FLUX converter hard-codes FLUX.1's widths (3072 / 12288), which the tiny model
        # lacks (tests/test_sd3_flux.py checks those names structurally)
        if family in ("sd15", "sdxl"):
            loaders[f"{family}-lora-kohya"] = lambda f=family: lora(f, f"{f}-lora.kohya.safetensors")
    out = {"versions": {"transformers": transformers.__version__, "diffusers": diffusers.__version__}}
    for name, load in loaders.items():
        try:
            out[name] = load()
        except Exception as e:  # a failure to load is the finding: report it, go on with the rest
            out[name] = f"FAILED: {type(e).__name__}: {e}"[:300]
    return out


def train_outputs(work: Path, python: Path) -> None:
    """The outputs to compare, trained on the CPU by ``python``'s sdplan."""
    sdplan = [str(python), "-c", "from sdplan.cli import main; main()"]

    def run(*args: str) -> None:
        # cwd: not the checkout, whose sdplan/ would shadow the installed package under `python -c`
        subprocess.run([*sdplan, *args], check=True, stdout=subprocess.DEVNULL, cwd=work)

    for family in FAMILIES:
        run("train", "--demo", "--model", family, "--out", str(work / f"{family}-lora"), "--force")
    for name, (family, method, extra) in RUNS.items():
        demo = work / f"{family}-lora"
        run(
            "train", "--method", method, "--out", str(work / name), "--device", "cpu",
            "--model", str(demo / "base_model"), "--dataset", str(demo / "dataset"),
            "--yes", "training.max_steps=2", *extra,
        )  # fmt: skip


def older_python(venv: Path, stack: list[str]) -> Path:
    """A virtual environment that sees this one's packages (torch, peft, ...) but ``stack`` first."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        # appended after the venv's own site-packages: the pinned older packages win over this environment's
        Path(site, "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *stack], check=True)
    return python


def install_sdplan(python: Path) -> None:
    """This checkout's sdplan into the older environment (not editable: it must import there on its own)."""
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)]
    subprocess.run(pip, check=True)


def compare(now: dict, older: dict) -> list[str]:
    lines, names = [], [k for k in now if k != "versions"]
    for name in names:
        a, b = now[name], older.get(name)
        if isinstance(a, str) or isinstance(b, str) or a != b:
            lines.append(f"DIFFERS {name}\n  {now['versions']}: {a}\n  {older['versions']}: {b}")
        else:
            lines.append(f"same    {name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="folder for the trained outputs (default: a temporary one)")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "sdplan-older-stack")
    parser.add_argument(
        "--stack",
        nargs="+",
        default=list(OLDER_STACK),
        help="the older packages, pinned (default: %(default)s); e.g. the oldest pyproject.toml allows",
    )
    parser.add_argument(
        "--train-with",
        choices=("this", "older"),
        default="this",
        help="which stack trains the outputs (older: sdplan itself runs on transformers 4.x)",
    )
    parser.add_argument("--fingerprint", type=Path, help=argparse.SUPPRESS)  # internal: run in each stack
    args = parser.parse_args(argv)
    if args.fingerprint:
        print(json.dumps(fingerprint(args.fingerprint)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        older = older_python(args.venv, args.stack)
        if args.train_with == "older":
            install_sdplan(older)
        train_outputs(work, older if args.train_with == "older" else Path(sys.executable))
        results = []
        for python in (Path(sys.executable), older):
            env = dict(os.environ, PYTHONWARNINGS="ignore")
            proc = subprocess.run(
                [str(python), __file__, "--fingerprint", str(work)],
                capture_output=True, text=True, env=env, check=True,
            )  # fmt: skip
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    lines = compare(*results)
    print(f"{results[0]['versions']} vs {results[1]['versions']}")
    print("\n".join(lines))
    return 1 if any(not line.startswith("same") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
