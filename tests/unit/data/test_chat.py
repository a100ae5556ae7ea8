"""Conversations: assistant-only labels proven exact on three families' chat templates, BOS once,
truncation that never keeps a turn without its end token, formats converted, several datasets mixed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hftk.config.options import DataConfig
from hftk.data import chat
from hftk.data.chat import IGNORE_INDEX

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
# family -> (template file, bos, end-of-turn token, extra special tokens, tokenizer adds BOS itself)
FAMILIES = {
    "llama3": ("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], True),
    "qwen2": ("qwen2.jinja", None, "<|im_end|>", ["<|im_start|>"], False),
    "mistral": ("mistral.jinja", "<s>", "</s>", [], True),
    "qwen2_generation": ("qwen2_generation.jinja", None, "<|im_end|>", ["<|im_start|>"], False),
}


def family_tokenizer(family: str):
    """A byte-level BPE tokenizer (trained on the shipped corpus) dressed as the family's: its special
    tokens, its BOS behaviour (Llama / Mistral put BOS in front of what they encode) and its template."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from hftk.data.builtin import tokenizer_for_corpus

    file, bos, eot, extra, adds_bos = FAMILIES[family]
    backend = Tokenizer.from_str(tokenizer_for_corpus().backend_tokenizer.to_str())
    backend.add_special_tokens([t for t in (bos, eot, *extra) if t])
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eot, pad_token=eot,
                                   chat_template=(TEMPLATES / file).read_text())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, family_tokenizer(request.param)


def conversation(turns: int, system: bool = True) -> list[dict[str, str]]:
    """``turns`` user/assistant exchanges, non-ASCII included."""
    messages = [{"role": "system", "content": "Tu es un assistant concis. Réponds brièvement."}] if system else []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: wie heißt die Stadt Nr. {i}? 東京?"})
        messages.append({"role": "assistant", "content": f"Antwort {i}: Zürich — naïve café, {i * 7}."})
    return messages


@pytest.mark.parametrize("turns,system", [(1, False), (2, True), (5, True)])
def test_labels_are_exactly_the_assistant_turns_and_their_end_token(family, turns, system):
    name, tokenizer = family
    eot = FAMILIES[name][2]
    messages = conversation(turns, system)
    enc = chat.encode_conversation(tokenizer, messages, tokenizer.chat_template)
    labels = chat.labels_for(enc, train_on_prompt=False)
    runs, current = [], []
    for token, label in zip(enc.input_ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    decoded = [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]
    assert decoded == [m["content"] + eot for m in messages if m["role"] == "assistant"]
    # the ids are the template's own rendering, tokenised without extra special tokens
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(enc.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == rendered


def test_generation_markers_and_the_prefix_method_agree():
    """transformers' assistant mask ({% generation %}) and hftk's prefix rendering label the same tokens."""
    marked, plain = family_tokenizer("qwen2_generation"), family_tokenizer("qwen2")
    messages = conversation(3)
    a = chat.encode_conversation(marked, messages, marked.chat_template)
    b = chat.encode_conversation(plain, messages, plain.chat_template)
    assert chat.GENERATION_TAG.search(marked.chat_template) and not chat.GENERATION_TAG.search(plain.chat_template)
    assert a.input_ids == b.input_ids and a.spans == b.spans and len(a.spans) == 3


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2"])
def test_bos_once_at_the_start(name):
    tokenizer = family_tokenizer(name)
    bos = tokenizer.bos_token_id
    enc = chat.encode_conversation(tokenizer, conversation(2), tokenizer.chat_template)
    if FAMILIES[name][4]:  # Llama-style: the template's own BOS, not doubled by the tokenizer's
        assert enc.input_ids[0] == bos and enc.input_ids.count(bos) == 1
        assert tokenizer("x")["input_ids"][0] == bos  # the tokenizer does add one by itself
    else:
        assert bos is None or bos not in enc.input_ids


def test_llama_tokenizer_sees_bos_once_in_text_and_prompt_completion():
    from hftk.data.dataset import encode_batch

    tokenizer = family_tokenizer("llama3")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    cfg = DataConfig()
    text = encode_batch({"text": ["In the beginning"]}, tokenizer, cfg, "text")["input_ids"][0]
    assert text[0] == bos and text.count(bos) == 1 and text[-1] == eos
    pc = encode_batch({"prompt": ["Q?"], "completion": [" A."]}, tokenizer, cfg, "prompt_completion")
    assert pc["input_ids"][0][0] == bos and pc["input_ids"][0].count(bos) == 1
    assert pc["labels"][0][0] == IGNORE_INDEX  # BOS is part of the prompt


def test_chat_template_without_bos_gets_the_tokenizers_bos_once():
    """A ChatML template on a tokenizer that adds BOS itself: BOS is put in front once."""
    tokenizer = family_tokenizer("llama3")
    enc = chat.encode_conversation(tokenizer, conversation(1), chat.resolve_template("chatml"))
    assert enc.input_ids[0] == tokenizer.bos_token_id and enc.input_ids.count(tokenizer.bos_token_id) == 1
    # spans moved with it: still exactly the assistant text + end token
    s, e = enc.spans[0]
    assert tokenizer.decode(enc.input_ids[s:e], skip_special_tokens=False) == conversation(1)[-1]["content"] + "<|im_end|>"


def test_train_on_prompt_labels_every_token_up_to_the_last_turn():
    tokenizer = family_tokenizer("qwen2")
    enc = chat.encode_conversation(tokenizer, conversation(2), tokenizer.chat_template)
    labels = chat.labels_for(enc, train_on_prompt=True)
    end = enc.spans[-1][1]
    assert labels[:end] == enc.input_ids[:end] and set(labels[end:]) <= {IGNORE_INDEX}


def test_truncation_keeps_only_whole_assistant_turns():
    tokenizer = family_tokenizer("qwen2")
    enc = chat.encode_conversation(tokenizer, conversation(3), tokenizer.chat_template)
    (s0, e0), (s1, e1), _ = enc.spans
    cut = chat.truncate(enc, (s1 + e1) // 2)  # inside the second assistant turn
    assert cut is not None and cut.spans == [(s0, e0)] and len(cut.input_ids) == (s1 + e1) // 2
    labels = chat.labels_for(cut, train_on_prompt=False)
    assert [i for i, x in enumerate(labels) if x != IGNORE_INDEX] == list(range(s0, e0))
    assert chat.truncate(enc, e0 - 1) is None  # not even the first turn ends inside: nothing to train on


def test_template_that_rewrites_earlier_turns_is_refused():
    from hftk.core.errors import HftkError

    tokenizer = family_tokenizer("qwen2")
    # the number of turns is printed up front: an earlier rendering is not a prefix of a later one
    tokenizer.chat_template = "{{ messages|length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(HftkError, match="data.chat_template"):
        chat.encode_conversation(tokenizer, conversation(1), tokenizer.chat_template)


def builtin_tokenizer():
    from hftk.config.options import ModelConfig
    from hftk.models.loading import load_tokenizer

    return load_tokenizer(ModelConfig(model_name_or_path="builtin:gpt2-tiny"))


@pytest.mark.parametrize("file,eot", [("llama3.jinja", "<|eot_id|>"), ("qwen2.jinja", "<|im_end|>"),
                                      ("qwen2_generation.jinja", "<|im_end|>"), ("mistral.jinja", None)])
def test_end_of_turn_is_the_marker_right_after_a_messages_content(file, eot):
    assert chat.end_of_turn((TEMPLATES / file).read_text()) == eot


def test_end_of_turn_after_a_content_expression_closed_before_the_marker():
    assert chat.end_of_turn("{% for m in messages %}{{ message['content'] | trim }}<|end|>{% endfor %}") == "<|end|>"
    assert chat.end_of_turn(chat.resolve_template("chatml")) == "<|im_end|>"


def test_markers_already_tokens_of_the_tokenizer_are_not_missing(family):
    name, tokenizer = family
    assert chat.missing_markers(tokenizer, tokenizer.chat_template) == []


def test_chatml_markers_become_single_special_tokens_and_the_end_of_turn_the_eos(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = builtin_tokenizer()
    template = chat.resolve_template("chatml")
    before, pad = len(tokenizer), tokenizer.pad_token
    assert chat.missing_markers(tokenizer, template) == ["<|im_start|>", "<|im_end|>"]
    assert len(tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1  # today: trained as text

    said = chat.add_chat_tokens(tokenizer, template)
    assert said.startswith("added <|im_start|>, <|im_end|> as special tokens; EOS is <|im_end|>")
    assert len(tokenizer) == before + 2 and tokenizer.pad_token == pad
    assert tokenizer.convert_ids_to_tokens(tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) == ["<|im_end|>"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == before + 1
    assert chat.add_chat_tokens(tokenizer, template) is None  # nothing missing any more

    # Every assistant turn's labels end on the EOS: the model learns to stop there.
    tokenizer.chat_template = template
    enc = chat.encode_conversation(tokenizer, conversation(2), template)
    assert [enc.input_ids[e - 1] for _, e in enc.spans] == [tokenizer.eos_token_id] * 2

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (len(reloaded), reloaded.eos_token, reloaded.pad_token) == (before + 2, "<|im_end|>", pad)
    assert reloaded("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == before
