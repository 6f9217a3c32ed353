"""Text conditioning: tokenizing captions, encoding them with the text encoder(s) (SD 1.x/2.x and
SDXL), SDXL's size micro-conditioning, and the cache of frozen text-encoder outputs.
"""

from __future__ import annotations

from typing import Any

from .progress import say


def tokenize(tokenizers: list, captions: list[str]) -> list:
    return [
        tok(
            captions,
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        for tok in tokenizers
    ]


def reading_tokenizer(comps) -> tuple[Any, str] | None:
    """(tokenizer, name) of the text encoder that reads the most of a caption or prompt: T5 for SD3.5 / FLUX.1
    (their CLIPs stop at 77 tokens, T5 reads on), CLIP otherwise; None without tokenizers."""
    from sdplan.registry import FLOW_FAMILIES

    tokenizers = list(getattr(comps, "tokenizers", None) or [])
    if not tokenizers:
        return None
    flow = comps.family in FLOW_FAMILIES
    return (tokenizers[-1], "T5") if flow else (tokenizers[0], "CLIP")


def _shorter_than_tokens(text: str, limit: int) -> bool:
    """Whether ``text`` surely fits ``limit`` tokens (start and end counted) without tokenizing it: ASCII text of
    at most limit - 2 characters (an ASCII character is at least a token's worth; CLIP's byte-level BPE spends up
    to 4 tokens on a CJK character or an emoji it has no merge for)."""
    return text.isascii() and len(text) <= limit - 2


def read_part(tokenizer: Any, text: str) -> str:
    """``text`` as far as the text encoder reads it (``tokenizer.model_max_length`` tokens, start and end
    counted): all of it where it fits, else its longest start of whole words that fits and an ellipsis where
    it was cut (what a sample grid's label shows: the words past it do not make the image)."""
    from .sampling import ELLIPSIS

    limit = int(tokenizer.model_max_length)

    def fits(part: str) -> bool:  # truncation at a length never reached: no "longer than the maximum" warning
        return len(tokenizer(part, truncation=True, max_length=10**7)["input_ids"]) <= limit

    def most(pieces: list[str], sep: str) -> int:
        """The most of ``pieces`` whose start fits (the whole does not)."""
        low, high = 0, len(pieces) - 1
        while low < high:
            mid = (low + high + 1) // 2
            if fits(sep.join(pieces[:mid])):
                low = mid
            else:
                high = mid - 1
        return low

    if _shorter_than_tokens(text, limit) or fits(text):
        return text
    words = text.split(" ")
    n = most(words, " ")
    # a first word past the limit alone (tags without spaces): the characters that fit
    start = " ".join(words[:n]) if n else text[: most(list(text), "")]
    return start.rstrip() + ELLIPSIS


def long_captions_note(
    tokenizer: Any, captions: list[str], encoder: str, what: str = "caption", prompts: bool = False
) -> str:
    """How many of ``captions`` (one per image) run past what ``encoder`` reads (``tokenizer.model_max_length``
    tokens, its start and end tokens counted), whose end :func:`tokenize` cuts, in training as in sampling;
    "" when none does. The SD pipelines warn of this at each prompt; a dataset's captions are said once.
    ``what``: what the texts are ("sample prompt"); ``prompts``: they are the grids' prompts, which train
    nothing (their labels show the part read: :func:`read_part`)."""
    limit = int(tokenizer.model_max_length)
    # a token is at least one character: a caption shorter than the limit (less the start and end) fits
    maybe = sorted({c for c in captions if not _shorter_than_tokens(c, limit)})
    if not maybe:
        return ""
    lengths = dict(zip(maybe, map(len, tokenizer(maybe, truncation=True, max_length=10**7)["input_ids"])))
    long = {c for c, n in lengths.items() if n > limit}
    if not long:
        return ""
    from .dataset_scan import count_of

    n = sum(1 for c in captions if c in long)
    where = (
        "in the sample grids (their labels show the part read, cut with an ellipsis)"
        if prompts
        else "in training as in use"
    )
    return (
        f"{count_of(n, what)} run{'s' if n == 1 else ''} past the {limit} tokens {encoder} reads (the longest: "
        f"{max(lengths[c] for c in long)}): the words after that are cut, {where}; shorten "
        f"{'it' if n == 1 else 'them'}, or put what matters first"
    )


def encode_prompts(text_encoders: list, input_ids: list, family: str, device):
    """(prompt_embeds, pooled). SD 1.x/2.x: last hidden state, no pooled. SDXL: both encoders' penultimate
    hidden states concatenated, pooled (projected) output of the second."""
    import torch

    from sdplan.registry import FLOW_FAMILIES

    if family in FLOW_FAMILIES:  # SD3.5 / FLUX.1: CLIP(s) and T5
        from .flow import encode_prompts as encode_flow

        return encode_flow(text_encoders, input_ids, family, device)
    if family != "sdxl":
        return text_encoders[0](input_ids[0].to(device))[0], None
    embeds, pooled = [], None
    for te, ids in zip(text_encoders, input_ids):
        out = te(ids.to(device), output_hidden_states=True)
        pooled = out[0]
        embeds.append(out.hidden_states[-2])
    return torch.cat(embeds, dim=-1), pooled


def add_time_ids(batch: dict, device, dtype):
    """SDXL micro-conditioning per sample: original (h, w), crop (top, left), target (h, w)."""
    import torch

    target = tuple(batch["pixel_values"].shape[-2:])
    rows = []
    for orig, crop in zip(batch["original_size"], batch["crop_top_left"]):
        rows.append([int(orig[0]), int(orig[1]), int(crop[0]), int(crop[1]), int(target[0]), int(target[1])])
    return torch.tensor(rows, device=device, dtype=dtype)


def unet_conditioning(components, batch: dict, text_encoders: list, device, dtype, text_cache=None):
    """encoder_hidden_states and added_cond_kwargs for one batch (from the text cache when there is one)."""
    if text_cache is not None:
        embeds, pooled = text_cache.lookup(list(batch["caption"]), device, dtype)
    else:
        ids = tokenize(components.tokenizers, list(batch["caption"]))
        embeds, pooled = encode_prompts(text_encoders, ids, components.family, device)
    embeds = embeds.to(device, dtype)
    if components.family != "sdxl":
        return embeds, None
    added = {"text_embeds": pooled.to(device, dtype), "time_ids": add_time_ids(batch, device, dtype)}
    return embeds, added


class TextCache:
    """Text-encoder outputs per caption (CPU), for runs whose text encoders are frozen: computed once before
    training for every caption the epochs will use, so the encoders can leave the GPU."""

    def __init__(self):
        self.embeds: dict[str, Any] = {}

    def missing(self, captions) -> set[str]:
        """The captions of ``captions`` not in the cache yet."""
        return set(captions) - set(self.embeds)

    def precompute(
        self, comps, text_encoders, captions, device, batch_size: int | None = None, on_batch=None
    ) -> int:
        """Encode the captions of ``captions`` the cache lacks, ``batch_size`` at a time (None: the family's,
        sdplan.registry.text_cache_batch); returns how many. ``on_batch(done)``: called after each batch with
        the captions encoded so far."""
        import torch

        from sdplan.registry import text_cache_batch

        batch_size = batch_size or text_cache_batch(comps.family)
        todo = sorted(self.missing(captions))
        with torch.no_grad():
            for i in range(0, len(todo), batch_size):
                chunk = todo[i : i + batch_size]
                embeds, pooled = encode_prompts(
                    text_encoders, tokenize(comps.tokenizers, chunk), comps.family, device
                )
                for j, caption in enumerate(chunk):
                    self.embeds[caption] = (
                        embeds[j].to("cpu"),
                        pooled[j].to("cpu") if pooled is not None else None,
                    )
                if on_batch is not None:
                    on_batch(i + len(chunk))
        return len(todo)

    def lookup(self, captions: list[str], device, dtype):
        import torch

        missing = [c for c in captions if c not in self.embeds]
        if missing:
            raise KeyError(f"caption not in the text cache: {missing[0]!r}")
        embeds = torch.stack([self.embeds[c][0] for c in captions]).to(device, dtype)
        first = self.embeds[captions[0]][1]
        pooled = (
            None if first is None else torch.stack([self.embeds[c][1] for c in captions]).to(device, dtype)
        )
        return embeds, pooled


def epoch_captions(dataset, epochs: int) -> set[str]:
    """Every caption ``dataset`` yields over ``epochs`` epochs (tag shuffling varies them per epoch; caption
    dropout adds the empty one)."""
    captions: set[str] = set()
    keep = dataset.epoch
    try:
        for epoch in range(epochs if getattr(dataset, "shuffle_tags", 0) else 1):
            dataset.set_epoch(epoch)
            for index in range(len(dataset)):
                item = dataset.items[dataset._index[index]]
                captions.add(dataset.caption_for(item, index))
    finally:
        dataset.set_epoch(keep)
    if getattr(dataset, "caption_dropout", 0):
        captions.add("")  # the samples data.caption_dropout trains on the empty caption
    return captions


def make_text_cache(
    accelerator, cfg, comps, text_encoders, captions, device, cache: TextCache | None = None
) -> TextCache | None:
    """Cache text-encoder outputs when ``memory.cache_text_encoder_outputs`` is on (the config refuses it for
    runs that train a text encoder; callers pass only frozen ones). ``cache``: one made earlier, topped up
    with the captions it lacks (said only when there are some)."""
    if not cfg.memory.cache_text_encoder_outputs:
        return None
    if cache is None:
        cache = TextCache()
    elif not cache.missing(captions):
        return cache
    from .progress import Progress

    more = bool(cache.embeds)
    # a text-encoder pass over every caption (T5-XXL over a large dataset's: minutes) said only once it was done:
    # a bar, as the latent cache's (main process)
    bar = Progress(
        accelerator,
        len(cache.missing(captions)),
        description="caching text encoder outputs",
        unit="caption",
    )
    try:
        n = cache.precompute(comps, text_encoders, captions, device, on_batch=bar.update)
    finally:
        bar.close()
    say(accelerator, f"text cache: {n} {'more ' if more else ''}captions encoded")
    return cache
