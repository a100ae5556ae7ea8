"""Chat templates and conversations: choose the template, render with ``apply_chat_template``, mark
the assistant tokens that carry the loss, keep BOS single.

The template is set on the tokenizer object the engines save into every checkpoint and ``final/``,
so the trained model renders prompts exactly as it saw them in training.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hftk.core.errors import HftkError

IGNORE_INDEX = -100
TEMPLATES = Path(__file__).with_name("templates")
SHIPPED = {p.stem: p for p in sorted(TEMPLATES.glob("*.jinja"))}
ROLES = ("system", "user", "assistant", "tool")
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# A template "supports tools" when it branches on the role 'tool' (transformers has no such flag).
TOOL_ROLE = re.compile(r"""['"]tool['"]""")


def resolve_template(value: str) -> str:
    """The Jinja text of ``--chat_template``: a shipped name or a file path."""
    if value in SHIPPED:
        return SHIPPED[value].read_text()
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise HftkError("data.chat_template", f"'{value}' is neither a shipped template nor a file.",
                    f"use one of: {', '.join(SHIPPED)}, or the path of a Jinja file.")


def apply_template_choice(tokenizer: Any, chat_template: str | None) -> Any:
    """Put the chosen template on the tokenizer (saved with it); the tokenizer's own one otherwise."""
    if chat_template:
        tokenizer.chat_template = resolve_template(chat_template)
    return tokenizer


def require_template(tokenizer: Any, why: str) -> str:
    """The tokenizer's template; never pick one silently when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise HftkError("data.chat_template", f"the tokenizer has no chat template and {why}.",
                        f"pass --chat_template NAME|PATH (shipped: {', '.join(SHIPPED)}).")
    if isinstance(template, dict):  # several named templates: the one apply_chat_template uses
        template = template.get("default") or next(iter(template.values()))
    return template


def supports_tools(template: str) -> bool:
    return bool(TOOL_ROLE.search(template))


def bos_prefix(tokenizer: Any) -> list[int]:
    """``[bos]`` when the tokenizer itself puts BOS in front of what it encodes (Llama), else ``[]``."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if ids and ids[0] == bos and bos != tokenizer.eos_token_id else []


def with_bos(ids: list[int], prefix: list[int]) -> tuple[list[int], int]:
    """BOS once at the start: added when the tokenizer wants one and the rendering lacks it (a template
    with its own ``bos_token`` is not doubled). Returns the ids and how far they shifted."""
    if prefix and ids[:1] != prefix:
        return prefix + ids, len(prefix)
    return ids, 0


@dataclass
class Encoded:
    input_ids: list[int]
    spans: list[tuple[int, int]]  # token [start, end) of each assistant turn, end-of-turn token included


def encode_conversation(tokenizer: Any, messages: list[dict[str, str]], template: str) -> Encoded:
    """Token ids of the rendered conversation and the token span of every assistant turn."""
    if GENERATION_TAG.search(template):
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        spans = _runs(mask)
    else:
        ids, spans = _prefix_spans(tokenizer, messages, template)
    ids, shift = with_bos(ids, bos_prefix(tokenizer))
    return Encoded(ids, [(s + shift, e + shift) for s, e in spans])


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _prefix_spans(tokenizer: Any, messages: list[dict[str, str]],
                  template: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Assistant spans for templates without ``{% generation %}`` markers (most Hub templates).

    Written by hand because transformers marks assistant tokens only through those markers. It is
    exact by construction: the text before assistant turn i is the conversation up to i rendered with
    the generation prompt, the turn ends where the conversation up to and including i ends (trailing
    whitespace after the end-of-turn token excluded: generation stops at that token); both renderings
    must be prefixes of the full one, and the token boundaries must fall on those character positions,
    otherwise the template is refused instead of mislabelled.
    """
    def render(turns: list[dict[str, str]], **kw: Any) -> str:
        return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False, **kw)

    full = render(messages)
    char_spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        upto = render(messages[:i + 1]).rstrip()
        if not (full.startswith(upto) and upto.startswith(before)):
            raise HftkError("data.chat_template", "the template does not render a conversation as the sum of its "
                            "turns (earlier turns change when later ones are added), so assistant tokens cannot "
                            "be located exactly.",
                            "use a template with {% generation %} markers, or pass --train_on_prompt.")
        char_spans.append((len(before), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = {s: i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s}
    ends = {e: i + 1 for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s}
    spans = []
    for start, end in char_spans:
        if start not in starts or end not in ends:
            raise HftkError("data.chat_template", "a token of the tokenizer crosses the start or end of an "
                            "assistant turn, so its tokens cannot be labelled exactly.",
                            "use a template with {% generation %} markers, or pass --train_on_prompt.")
        spans.append((starts[start], ends[end]))
    return list(enc["input_ids"]), spans


def labels_for(enc: Encoded, train_on_prompt: bool) -> list[int]:
    """Loss on the assistant turns only (or on every token up to the last assistant turn's end)."""
    if train_on_prompt:
        end = enc.spans[-1][1] if enc.spans else 0
        return enc.input_ids[:end] + [IGNORE_INDEX] * (len(enc.input_ids) - end)
    labels = [IGNORE_INDEX] * len(enc.input_ids)
    for s, e in enc.spans:
        labels[s:e] = enc.input_ids[s:e]
    return labels


def truncate(enc: Encoded, block_size: int) -> Encoded | None:
    """The first ``block_size`` tokens, keeping only the assistant turns that end inside them (a turn
    without its end-of-turn token would teach the model never to stop). None when none is left."""
    spans = [(s, e) for s, e in enc.spans if e <= block_size]
    return Encoded(enc.input_ids[:block_size], spans) if spans else None


# A template's marker literals: ``<|im_start|>``, ``<|eot_id|>``, ...
MARKER = re.compile(r"<\|[^|\s<>'\"]+\|>")
# The marker written right after a message's content, inside one expression (``content + '<|im_end|>'``)
# or just after it (``{{ message['content'] }}<|im_end|>``): the end of a turn.
END_OF_TURN = re.compile(r"""message(?:\[['"]content['"]\]|\.content)(?:\s*\|\s*\w+)*\s*(?:\+\s*['"]|-?}}\s*)"""
                         r"(" + MARKER.pattern + ")")


def missing_markers(tokenizer: Any, template: str) -> list[str]:
    """The template's ``<|...|>`` markers that the tokenizer does not encode as one token, in order."""
    found = dict.fromkeys(MARKER.findall(template))
    return [m for m in found if len(tokenizer(m, add_special_tokens=False)["input_ids"]) != 1]


def end_of_turn(template: str) -> str | None:
    """The marker that closes a message in ``template`` (what generation must stop on), if it has one."""
    match = END_OF_TURN.search(template)
    return match.group(1) if match else None


def add_chat_tokens(tokenizer: Any, template: str) -> str | None:
    """Make the template's markers single special tokens and its end-of-turn marker the EOS, as TRL's
    ``clone_chat_template`` does for a template cloned from another tokenizer (it needs that tokenizer;
    hftk has only the template text). Returns the line to print, or None when nothing was missing.

    The pad token stays what it was (GPT-2's pad is its old EOS): padding is masked out either way.
    The model's embeddings grow to ``len(tokenizer)`` in ``models.loading.fit_to_tokenizer``."""
    missing = missing_markers(tokenizer, template)
    if not missing:
        return None
    tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    eos = end_of_turn(template)
    said = f"added {', '.join(missing)} as special tokens"
    if eos in missing:
        tokenizer.eos_token = eos
        said += f"; EOS is {eos}"
    return said + " (--no_add_chat_tokens keeps them as text)"
