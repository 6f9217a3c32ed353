"""The training methods and model families sdplan knows: the one list every layer reads.

The config schema, the profile loader, the planner, `recommend`, `train`, `doctor` and `bench` take their
names from here. Adding a family is one :class:`Family` entry here, plus its profile
(``profiles/models/<name>.yaml`` and its activations) and its trainer support; adding a method is one
:class:`Method` entry, plus its recipe (``sdplan.trainer.recipes.<recipe>``) and its profile
(``profiles/methods/<name>.yaml``). Pure data: no torch, no I/O (``sdplan recommend`` imports it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from sdplan.errors import UsageError


@dataclass(frozen=True)
class Method:
    name: str  # as in sdplan.yaml's `method`, the CLI's --method and profiles/methods/<name>.yaml
    label: str
    trains: str  # "unet": every UNet weight | "adapter": LoRA matrices | "embeddings": new token vectors
    recipe: str  # the trainer module sdplan.trainer.recipes.<recipe>
    learning_rate: float  # training.learning_rate when the config leaves it out (sources in METHOD_LIST)
    aliases: tuple[str, ...] = ()
    # keeps an EMA of the trained weights when ema.enabled (as diffusers' text-to-image script)
    ema: bool = False
    # the sdplan.yaml sections only this method's recipe reads: a key=value setting in one, given to another
    # method, is refused (sdplan.config.method_setting_problems), not ignored
    sections: tuple[str, ...] = ()

    @property
    def full_weights(self) -> bool:
        """Trains the whole UNet (its weights, gradients and optimizer state dominate memory)."""
        return self.trains == "unet"

    @property
    def optimizers(self) -> tuple[str, ...]:
        """The optimizers the planner considers: every one the trainer runs, for every method. Textual
        inversion trains a few vectors, but its optimizer takes the text encoders' whole embedding matrices
        (trainer/recipes/textual_inversion.py param_groups: 0.8 GiB of AdamW state on SDXL), so 8-bit AdamW and
        Adafactor save memory there too."""
        return OPTIMIZERS


@dataclass(frozen=True)
class Family:
    name: str  # as in sdplan.yaml's `model.family`, the CLI's --model and profiles/models/<name>.yaml
    label: str
    text_encoders: (
        int  # text encoders the pipeline conditions on (SDXL: two CLIPs; SD3.5: CLIP-L, CLIP-G, T5)
    )
    name_hints: tuple[str, ...] = ()  # substrings of a hub id that name this family (checked in order)
    aliases: tuple[str, ...] = ()
    # The denoiser and its objective: "unet" (SD 1.x/2.x/SDXL: UNet2DConditionModel, DDPM epsilon/v objective),
    # "mmdit" (SD3.5: SD3Transformer2DModel) or "flux" (FLUX.1: FluxTransformer2DModel), both rectified flow.
    arch: str = "unet"
    encoders: tuple[str, ...] = ("clip-l",)  # text encoders in the pipeline's order: clip-l | clip-g | t5
    t5_max_length: int = 0  # T5 tokens the transformer sees (the pipelines' max_sequence_length)
    planned: bool = True  # the planner has profiles for it (`sdplan recommend` / `train` plan it)
    # the methods the planner plans for it (None: every method); the transformer families: LoRA, DreamBooth and
    # full fine-tune, what the bundled trainer's flow loop runs (FLOW_METHODS, read by trainer/flow.py); textual inversion
    # is not (no anchor supports it for a T5-conditioned model)
    methods: tuple[str, ...] | None = None
    # the family whose measured speeds also serve this one (the same network: its efficiency, its launch-bound
    # floor and its bench points near a plan's settings); None: its own
    speed_as: str | None = None

    @property
    def flow(self) -> bool:
        """A rectified-flow transformer family (SD3.5, FLUX.1), trained by ``sdplan.trainer.flow``."""
        return self.arch != "unet"

    @property
    def distilled_guidance(self) -> bool:
        """Samples at a guidance embedding of its own (FLUX.1: FluxPipeline's guidance_scale, one pass), not with
        classifier-free guidance: no unconditional pass, so no negative prompt."""
        return self.arch == "flux"

    def plans(self, method: str) -> bool:
        """The planner plans ``method`` for this family."""
        return self.methods is None or method in self.methods

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The modules a LoRA of this family adapts where lora.target_modules is null."""
        return LORA_TARGETS[self.arch]


OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")  # what the trainer runs and the planner searches over
# what the planner's memory and time model can predict (users' picks in kohya / OneTrainer / SimpleTuner);
# never chosen by the search, since they change the training dynamics: sdplan.planner.OPTIMIZER_STATE
MODELLED_OPTIMIZERS = (*OPTIMIZERS, "prodigy", "dadaptation", "lion", "lion8bit")
PRECISIONS = ("fp32", "fp16", "bf16")
FLOW_METHODS = ("lora", "finetune", "dreambooth")  # what the SD3.5 / FLUX.1 families train (trainer/flow.py)

# A LoRA's targets where lora.target_modules is null (peft suffixes: a module is adapted where its name is one or
# ends with "." + one): the one table the planner (planner.flow_lora_params, lora_target_set) and the trainer
# (trainer/recipes/lora.py) both read, through :func:`lora_targets`. SD 1.x/2.x/SDXL: the UNet's attention
# projections (diffusers' train_text_to_image_lora.py). SD3.5 and FLUX.1: the diffusers dreambooth examples'
# defaults for --lora_layers (profiles/models/<family>.yaml lora_target_modules cites them): SD3.5 the joint
# attention's image and context projections (``attn.*``, not MMDiT-X's ``attn2``); FLUX the same plus the double
# blocks' feed-forwards (the single blocks' ``attn.to_q/k/v`` match too, as in the example).
UNET_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
LORA_TARGETS = {
    "unet": UNET_LORA_TARGETS,
    "mmdit": (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ),
    "flux": (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ),
}
# lora.target_modules as sdplan wrote it before null meant "the family's default" (its default then, written
# into every sdplan.yaml and checkpoint): it meant the family's default on every family (an SD3.5 / FLUX.1 run
# trained LORA_TARGETS under it), and reads so (:func:`legacy_lora_targets`)
OLD_DEFAULT_LORA_TARGETS = list(UNET_LORA_TARGETS)
# storage of a frozen transformer base's Linear weights (LoRA on SD3.5 / FLUX.1): bf16, float8 (e4m3, per-tensor
# scale) or bitsandbytes 4-bit NormalFloat; bytes and hardware rules in sdplan.planner.BASE_PRECISION_BYTES
BASE_PRECISIONS = ("bf16", "fp8", "nf4")

# Learning rates as diffusers' example scripts for the method set them (examples/ at its August 2026 main):
# LoRA 1e-4 (text_to_image/train_text_to_image_lora.py's default), DreamBooth 5e-6 (dreambooth/
# train_dreambooth.py's default and its README's commands), full fine-tune 1e-5 (text_to_image/README.md's
# commands; the script's own default, 1e-4, is LoRA's), textual inversion 1e-4 (textual_inversion.py's default).
# A whole network trained at a LoRA's rate overfits or breaks within a few hundred steps.
METHOD_LIST = (
    Method("lora", "LoRA", trains="adapter", recipe="lora", learning_rate=1e-4, sections=("lora",)),
    Method("dreambooth", "DreamBooth", trains="unet", recipe="dreambooth", learning_rate=5e-6),
    Method(
        "finetune",
        "full fine-tune",
        trains="unet",
        recipe="finetune",
        learning_rate=1e-5,
        aliases=("fine-tune",),
        ema=True,
    ),
    Method(
        "textual-inversion",
        "textual inversion",
        trains="embeddings",
        recipe="textual_inversion",
        learning_rate=1e-4,
        aliases=("ti",),
        sections=("textual_inversion",),
    ),
)
FAMILY_LIST = (
    Family(
        "sd15",
        "Stable Diffusion 1.x",
        text_encoders=1,
        aliases=("sd1", "sd1.5", "sd14", "sd1.4"),
        name_hints=("v1-5", "v1-4", "sd15", "sd1.5", "sd-1-5"),
    ),
    Family(
        "sd21",
        "Stable Diffusion 2.x",
        text_encoders=1,
        name_hints=("2-1", "2.1", "sd21", "2-base", "diffusion-2"),  # not "v2": a model's own version 2
        aliases=("sd2", "sd2.1"),
    ),
    Family("sdxl", "Stable Diffusion XL", text_encoders=2, name_hints=("xl",), encoders=("clip-l", "clip-g")),
    # SD3.5 Medium and Large: one pipeline and code path (StableDiffusion3Pipeline), two networks (2.5B MMDiT-X
    # with qk-norm and dual attention vs 8B MMDiT), so two families for the planner. T5 256 tokens: the
    # pipeline's max_sequence_length default. FLUX.1 [dev] (guidance-distilled: a guidance embedder) and
    # [schnell] (none): the same network otherwise; T5 512 / 256 tokens (FluxPipeline default; BFL's and
    # kohya's 256 for schnell). Planned for LoRA (issue 14), DreamBooth and full fine-tune (the whole transformer
    # trains): sdplan.planner.memory_flow.
    Family(
        "sd35-medium",
        "Stable Diffusion 3.5 Medium",
        text_encoders=3,
        name_hints=("3.5-medium", "3-5-medium", "sd35-medium", "sd3.5m"),
        aliases=("sd35", "sd3.5", "sd3.5-medium"),
        arch="mmdit",
        encoders=("clip-l", "clip-g", "t5"),
        t5_max_length=256,
        methods=FLOW_METHODS,
    ),
    Family(
        "sd35-large",
        "Stable Diffusion 3.5 Large",
        text_encoders=3,
        name_hints=("3.5-large", "3-5-large", "sd35-large"),
        aliases=("sd3.5-large",),
        arch="mmdit",
        encoders=("clip-l", "clip-g", "t5"),
        t5_max_length=256,
        methods=FLOW_METHODS,
    ),
    Family(
        "flux-dev",
        "FLUX.1 [dev]",
        text_encoders=2,
        name_hints=("flux.1-dev", "flux1-dev", "flux-dev"),
        aliases=("flux", "flux1-dev", "flux.1-dev"),
        arch="flux",
        encoders=("clip-l", "t5"),
        t5_max_length=512,
        methods=FLOW_METHODS,
    ),
    Family(
        "flux-schnell",
        "FLUX.1 [schnell]",
        text_encoders=2,
        name_hints=("flux.1-schnell", "flux1-schnell", "flux-schnell", "schnell"),
        aliases=("flux1-schnell", "flux.1-schnell"),
        arch="flux",
        encoders=("clip-l", "t5"),
        t5_max_length=256,
        methods=FLOW_METHODS,
        speed_as="flux-dev",  # [dev]'s transformer without the guidance embedder (a 2-layer MLP)
    ),
)

METHODS = tuple(m.name for m in METHOD_LIST)
FAMILIES = tuple(f.name for f in FAMILY_LIST)
PLANNED_FAMILIES = tuple(f.name for f in FAMILY_LIST if f.planned)  # those the planner has profiles for
FLOW_FAMILIES = tuple(f.name for f in FAMILY_LIST if f.flow)
FULL_METHODS = tuple(m.name for m in METHOD_LIST if m.full_weights)
RECIPES = {m.name: m.recipe for m in METHOD_LIST}
DEFAULT_FAMILY = "sd15"  # a hub id whose name names no family


def text_cache_batch(family: str) -> int:
    """Captions the trainer's text cache encodes at a time (trainer/conditioning.py TextCache), which the
    planner's caption-pass peak counts (planner.text_cache_peak_bytes): one for SD3.5 / FLUX.1, whose T5-XXL
    holds ~165 MB of eager attention a caption at 256-512 tokens, where one caption already fills the GPU's
    matrix units; 16 for the CLIP encoders' 77 tokens (milliseconds a caption, a few MB each)."""
    return 1 if family in FLOW_FAMILIES else 16


def one_of(names: tuple[str, ...]) -> str:
    """'a, b or c': a list of names for help texts."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def method(name: str) -> Method:
    """The method called ``name`` (or one of its aliases); UsageError naming the closest otherwise."""
    return _lookup("method", name, METHOD_LIST)


def family(name: str) -> Family:
    """The family called ``name`` (or one of its aliases); UsageError naming the closest otherwise."""
    return _lookup("model", name, FAMILY_LIST)


def not_planned(name: str) -> UsageError:
    """The one-line error for a known family the planner has no profiles for yet."""
    fam = family(name)
    return UsageError(
        f"{fam.name} ({fam.label}): not yet planned for this family (no planner profile yet)",
        fix=f"plan one of {', '.join(PLANNED_FAMILIES)}, or train {fam.name} from a config file "
        "(sdplan train --config) with the batch size and memory settings set by hand",
    )


def not_supported(method_name: str, family_name: str) -> UsageError:
    """The one-line error for a method the planner does not plan for a family."""
    fam = family(family_name)
    meth = method(method_name)
    return UsageError(
        f"{meth.name} on {fam.name} ({fam.label}): not supported for this family",
        fix=f"use --method {' or '.join(fam.methods or METHODS)} for {fam.name}",
    )


def _lookup(kind: str, name: str, entries):
    key = str(name).strip().lower()  # as users type them: SDXL, LoRA
    for e in entries:
        if key == e.name or key in (a.lower() for a in e.aliases):
            return e
    names = [e.name for e in entries]
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(f"unknown {kind} {name!r}", fix=f"{hint}one of: {', '.join(names)}")


def lora_targets(family_name: str | None, targets: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The modules a LoRA of ``family_name`` adapts under ``lora.target_modules`` = ``targets``: null (None) the
    family's default (:data:`LORA_TARGETS`; an unknown or undetected family: the UNet's), a list exactly the
    modules it names, in any order (sorted, each once: peft matches them as a set). What the planner charges
    and the trainer trains."""
    if targets is None:
        fam = _find(family_name)
        return fam.default_lora_targets if fam is not None else UNET_LORA_TARGETS
    return tuple(sorted(set(targets)))


def legacy_lora_targets(targets: object) -> object:
    """lora.target_modules as read from an sdplan.yaml or a checkpoint's record: the list sdplan wrote as its
    default before null meant the family's default (:data:`OLD_DEFAULT_LORA_TARGETS`, in that order) is null,
    which it meant there on every family; anything else as it is. sdplan no longer writes that list in that
    order (the config keeps a pinned list sorted: sdplan.config.validate)."""
    return None if targets == OLD_DEFAULT_LORA_TARGETS else targets


def _find(name: str | None) -> Family | None:
    try:
        return family(name) if name else None
    except UsageError:
        return None


def family_from_name(model: str) -> str | None:
    """A hub id's family from its name, when its config cannot be read offline; None where the name has no
    hint."""
    name = model.lower()
    # the transformer families' specific hints first, then "xl" before sd21's looser hints
    for fam in sorted(FAMILY_LIST, key=lambda f: (not f.flow, f.name != "sdxl")):
        if any(h in name for h in fam.name_hints):
            return fam.name
    return None
