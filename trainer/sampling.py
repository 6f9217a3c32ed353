"""Sample images during and after training: one image per prompt from a fixed seed, saved as a PNG grid.

Every prompt starts from the same CPU-seeded noise, so grids from different steps (and machines) compare
like for like. Sampling leaves the training state alone: the global RNG streams are restored afterwards (a
resumed run stays identical to an uninterrupted one) and modules go back to train mode if they were in it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_COMPONENTS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")


@contextmanager
def _sampling_state(pipeline):
    """eval() for the pipeline's modules and a forked torch RNG; both restored on exit."""
    import torch

    modules = [getattr(pipeline, name, None) for name in _COMPONENTS]
    modules = [m for m in modules if isinstance(m, torch.nn.Module)]
    was_training = [m.training for m in modules]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        for m in modules:
            m.eval()
        try:
            yield
        finally:
            for m, training in zip(modules, was_training):
                m.train(training)


def _size(resolution: int | tuple[int, int]) -> tuple[int, int]:
    """(width, height) from an int or a (width, height) pair."""
    if isinstance(resolution, int):
        return resolution, resolution
    width, height = resolution
    return int(width), int(height)


CFG_GUIDANCE = 7.5  # SD 1.x/2.x, SDXL, SD3.5: classifier-free guidance (kohya's sample default)
FLUX_GUIDANCE = 3.5  # FLUX.1: the guidance embedding's value (FluxPipeline's default; kohya's sample default)


def guidance_for(guidance_scale: float | None, family: str) -> float:
    """The guidance scale to sample ``family`` with: ``sampling.guidance_scale``, or when it is null the
    family's. FluxPipeline's ``guidance_scale`` is FLUX.1 [dev]'s distilled guidance embedding (no second,
    unconditional pass; [schnell] ignores it), so the classifier-free 7.5 of the UNet families made its grids and
    DreamBooth class images at more than twice the 3.5 it is used at."""
    if guidance_scale is not None:
        return float(guidance_scale)
    from sdplan import registry

    return FLUX_GUIDANCE if registry.family(family).distilled_guidance else CFG_GUIDANCE


def _t5_length(pipeline) -> dict[str, int]:
    """SD3 / FLUX pipelines: ``max_sequence_length`` = the T5 tokens the transformer trained on (the T5
    tokenizer's ``model_max_length``, which ``flow_models`` sets to the family's ``t5_max_length``). Without it
    the pipeline pads T5 to its own default (FluxPipeline: 512), so FLUX.1 [schnell], trained on 256 tokens,
    was sampled on 512. Other pipelines: nothing."""
    import inspect

    if "max_sequence_length" not in inspect.signature(pipeline.__call__).parameters:
        return {}
    # SD3: tokenizer_3 (tokenizer_2 is CLIP-G's); FLUX: tokenizer_2
    t5 = pipeline.tokenizer_3 if hasattr(pipeline, "tokenizer_3") else getattr(pipeline, "tokenizer_2", None)
    length = getattr(t5, "model_max_length", None)
    return {"max_sequence_length": int(length)} if isinstance(length, int) and 0 < length <= 512 else {}


def generate_images(
    pipeline,
    prompts: list[str],
    *,
    seed: int,
    steps: int,
    guidance_scale: float,
    resolution: int | tuple[int, int],
    negative_prompt: str | list[str] | None = None,
    conditioning: Callable[[str, str | None], dict] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[Any]:
    """One PIL image per prompt, each from ``torch.Generator("cpu").manual_seed(seed)``; prompts run one at
    a time (a full-size model at 1024 px does not batch many on a small GPU). ``conditioning(prompt,
    negative)``: the pipeline's embedding arguments for a prompt, computed earlier (the pipeline's text encoders
    then never run: they can stay off the GPU); None: the pipeline encodes the prompt itself. ``on_step(n)``:
    called with the denoising steps done so far over all prompts (of ``len(prompts) * steps``), after each
    step where the pipeline takes diffusers' ``callback_on_step_end``, else after each image."""
    import inspect

    import torch

    if not prompts:
        raise ValueError("no prompts to sample")
    width, height = _size(resolution)
    if isinstance(negative_prompt, list) and len(negative_prompt) != len(prompts):
        raise ValueError(f"{len(negative_prompt)} negative prompts for {len(prompts)} prompts")
    pipeline.set_progress_bar_config(disable=True)
    per_step = (
        on_step is not None and "callback_on_step_end" in inspect.signature(pipeline.__call__).parameters
    )
    images = []
    with _sampling_state(pipeline):
        for i, prompt in enumerate(prompts):
            negative = negative_prompt[i] if isinstance(negative_prompt, list) else negative_prompt
            text = (
                conditioning(prompt, negative)
                if conditioning is not None
                else {"prompt": prompt, "negative_prompt": negative, **_t5_length(pipeline)}
            )
            callback = {}
            if per_step:

                def step_end(_pipe, index, _timestep, kwargs, done=i * steps):
                    if index < steps:  # PNDM (SD 1.x's default) calls it steps + 1 times: said once each
                        on_step(done + index + 1)
                    return kwargs

                callback = {"callback_on_step_end": step_end}
            result = pipeline(
                **text,
                num_inference_steps=steps,
                guidance_scale=guidance_scale,
                height=height,
                width=width,
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="pil",
                **callback,
            )
            if on_step is not None and not per_step:
                on_step((i + 1) * steps)
            image = result.images[0]
            if image.size != (width, height):
                raise RuntimeError(f"the pipeline made a {image.size} image for {width}x{height}")
            images.append(image)
    return images


def make_grid(images: list, cols: int | None = None, labels: list[str] | None = None):
    """Images pasted into a ``cols`` x ``rows`` grid (cells the size of the first image; ``cols`` defaults to
    ceil(sqrt(n))). ``labels`` go in a strip under each image, never over it (at 64 px a label over the image
    covered 40% of it): white on black, at least :data:`LABEL_MIN_PX` px high (each in a font that has its
    characters, scaled to the cell); a newline starts a line, long lines wrap, at most :data:`LABEL_LINES` in
    all. The last line of a label (the prompt) keeps its end where it is too long ("...red square": where
    prompts differ), the lines above it their start ("step 16"). The strip is as tall as the longest label."""
    from PIL import Image, ImageDraw

    if not images:
        raise ValueError("no images for a grid")
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    texts = list(labels[: len(images)]) if labels else []
    lines: list[list[str]] = []
    strip = line_h = 0
    fonts: list = []
    if texts:
        # a font per label, one that has its characters: one character no font has in one label (an emoji) drew
        # every label, a Chinese one included, in DejaVu Sans's boxes
        size = max(LABEL_MIN_PX, h // 24)
        fonts = [_font(size, text + ELLIPSIS) for text in texts]
        line_h = max(b - t for _, t, _, b in (f.getbbox("Ag") for f in fonts)) + 2
        measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
        lines = [_wrap(measure, font, text, w - 4, LABEL_LINES) for font, text in zip(fonts, texts)]
        strip = max(len(lab) for lab in lines) * line_h + 3
    cell_h = h + strip
    grid = Image.new("RGB", (cols * w, rows * cell_h), (0, 0, 0))
    for i, image in enumerate(images):
        if image.size != (w, h):
            raise ValueError(f"image {i} is {image.size}, the grid's cells are {(w, h)}")
        grid.paste(image.convert("RGB"), ((i % cols) * w, (i // cols) * cell_h))
    draw = ImageDraw.Draw(grid)
    for i, (label, font) in enumerate(zip(lines, fonts)):
        x, y = (i % cols) * w, (i // cols) * cell_h + h + 2
        top = font.getbbox("Ag")[1]
        for j, line in enumerate(label):
            draw.text((x + 2, y + j * line_h - top), line, font=font, fill=(255, 255, 255))
    return grid


LABEL_LINES = 3
LABEL_MIN_PX = 11  # DejaVu Sans at 11 px: about 10 characters across a 64 px cell
ELLIPSIS = "\u2026"


def _font(size: int, text: str = ""):
    """A font at ``size`` px that draws every character of ``text`` (:func:`_font_paths`), else PIL's bundled
    one (113 glyphs: no accents, no other script; it draws the rest as boxes)."""
    from PIL import ImageFont

    for path in _font_paths(frozenset(ord(c) for c in text if not c.isspace())):
        try:
            return ImageFont.truetype(path, size)
        except OSError:  # a file FreeType cannot open, or a colour-emoji font that has one size only
            continue
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or without FreeType: the fixed bitmap font
        return ImageFont.load_default()


@functools.cache
def _font_paths(codepoints: frozenset[int]) -> tuple[str, ...]:
    """The font files to try, in order, for labels with these characters: DejaVu Sans, which ships with
    matplotlib (accented Latin, Greek, Cyrillic), where it has them all; else first the regular face of a font
    installed on this machine that has them all (a Chinese or Japanese prompt needs one such as Noto Sans CJK;
    from matplotlib's list of the system's fonts, sans-serif first), then DejaVu Sans (what it lacks draws as
    boxes). None without matplotlib."""
    try:
        from matplotlib import font_manager
    except ImportError:
        return ()
    dejavu = font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans"))
    if codepoints <= _charmap(dejavu):
        return (dejavu,)
    regular = [
        f
        for f in font_manager.fontManager.ttflist
        if f.style == "normal"
        and f.weight in (400, "normal", "regular")
        # Last Resort (matplotlib ships it) has every character, each drawn as a box naming its Unicode block
        and not f.name.startswith("Last Resort")
    ]
    faces = sorted(regular, key=lambda f: "Sans" not in f.name)
    for face in faces:
        if codepoints <= _charmap(face.fname):
            return (face.fname, dejavu)
    # none has them all (an emoji beside Chinese): the one that has the most, so only the rest draw as boxes
    covered = {face.fname: len(codepoints & _charmap(face.fname)) for face in faces}
    best = max(covered, key=lambda f: covered[f], default=None)
    if best is not None and covered[best] > len(codepoints & _charmap(dejavu)):
        return (best, dejavu)
    return (dejavu,)


@functools.cache
def _charmap(path: str) -> frozenset[int]:
    """The characters the font file at ``path`` has glyphs for (empty where FreeType cannot read it)."""
    try:
        from matplotlib.ft2font import FT2Font

        return frozenset(FT2Font(path).get_charmap())
    except Exception:  # noqa: BLE001 - a broken or unusual font file is one that cannot draw the labels
        return frozenset()


def _wrap(draw, font, text: str, width: int, most: int = LABEL_LINES) -> list[str]:
    """``text`` in lines of at most ``width`` pixels: newlines break, then words; at most ``most`` lines. Where
    that is too many, the last paragraph (the prompt) loses its start ("...of sks red" / "square": its end is
    what tells prompts apart), the ones above it their end. A prompt that ends in an ellipsis (cut where the
    text encoder stops reading, ``conditioning.read_part``) keeps its start instead: the end it lost made
    nothing in the image."""
    paragraphs = [_words(draw, font, para, width) for para in text.split("\n")]
    head = [line for para in paragraphs[:-1] for line in para][: max(most - 1, 0)]
    tail = paragraphs[-1]
    room = max(most - len(head), 1)
    if text.endswith(ELLIPSIS):
        if len(tail) > room:
            tail = tail[:room]
            tail[-1] = tail[-1].removesuffix(ELLIPSIS) + ELLIPSIS
        return [_fit(draw, font, line, width) for line in head + tail]
    if len(tail) > room:
        tail = tail[-room:]
        tail[0] = ELLIPSIS + tail[0]
    return [_fit(draw, font, line, width) for line in head] + [
        _fit_end(draw, font, line, width) for line in tail
    ]


def _words(draw, font, text: str, width: int) -> list[str]:
    lines: list[str] = []
    line = ""
    for word in text.split(" "):
        candidate = f"{line} {word}" if line else word
        if line and draw.textlength(candidate, font=font) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return [*lines, line]


def _fit(draw, font, text: str, width: int) -> str:
    """``text`` cut at the end (with an ellipsis) to ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    text = text.removesuffix(ELLIPSIS)
    while text and draw.textlength(text + ELLIPSIS, font=font) > width:
        text = text[:-1]
    return text + ELLIPSIS


def _fit_end(draw, font, text: str, width: int) -> str:
    """``text`` cut at the start (with an ellipsis) to ``width`` pixels: its end stays."""
    if draw.textlength(text, font=font) <= width:
        return text
    text = text.removeprefix(ELLIPSIS)
    while text and draw.textlength(ELLIPSIS + text, font=font) > width:
        text = text[1:]
    return ELLIPSIS + text


def sample_grid(
    pipeline,
    prompts: list[str],
    *,
    seed: int,
    steps: int,
    guidance_scale: float,
    resolution: int | tuple[int, int],
    out_path: str | Path,
    negative_prompt: str | list[str] | None = None,
    cols: int | None = None,
    labels: bool | list[str] = False,
    conditioning: Callable[[str, str | None], dict] | None = None,
    on_step: Callable[[int], None] | None = None,
    record: dict | None = None,
) -> Path:
    """Generate one image per prompt and save them as one PNG grid of ``cols * width`` x ``rows * height``
    pixels (plus the label strips) (``cols`` defaults to ceil(sqrt(len(prompts)))); the prompts and settings go into the PNG's text
    chunks. ``labels``: True writes each prompt under its image, a list those texts (one per prompt), in a strip
    that adds to the grid's height (:func:`make_grid`).
    ``conditioning``, ``on_step``: as :func:`generate_images`. ``record``: more keys for the text chunk (the
    trainer's ``images_seen``: the point of the run the grid shows). Works for the SD 1.x/2.x, SDXL, SD3 and FLUX
    pipelines. Written atomically."""
    from PIL.PngImagePlugin import PngInfo

    images = generate_images(
        pipeline,
        prompts,
        seed=seed,
        steps=steps,
        guidance_scale=guidance_scale,
        resolution=resolution,
        negative_prompt=negative_prompt,
        conditioning=conditioning,
        on_step=on_step,
    )
    if isinstance(labels, list) and len(labels) != len(prompts):
        raise ValueError(f"{len(labels)} labels for {len(prompts)} prompts")
    drawn = list(labels) if isinstance(labels, list) else (list(prompts) if labels else None)
    grid = make_grid(images, cols=cols, labels=drawn)
    info = PngInfo()
    info.add_text(
        "sdplan_samples",
        json.dumps(
            {
                "prompts": list(prompts),
                "negative_prompt": negative_prompt,
                "seed": seed,
                "steps": steps,
                "guidance_scale": guidance_scale,
                "resolution": list(_size(resolution)),
                "pipeline": type(pipeline).__name__,
                "labels": drawn,
                **(record or {}),
            }
        ),
    )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        grid.save(tmp, format="PNG", pnginfo=info)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path
