"""BOS as the model's own tokenizer says, against transformers reading the same folder: the
post-processor's BOS (Gemma's, Llama 3's), tokenizer_config.json's add_bos_token, never twice
where a chat template writes it; generation_config.json's end ids end a reply."""

import json

import pytest
from tokenizers import processors

from glassformer.formats.chat_tokenizer import ChatTokenizer
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.config import GenerationConfig
from glassformer.generation.core import eos_ids

TEXT = "the capital of France is Paris. the capital of Italy is Rome. " * 20
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>"
            "{% endfor %}")


def _folder(folder, post_processor: bool, config: dict) -> ChatTokenizer:
    base = HFTokenizer.train_bpe([TEXT] * 4, 300).tokenizer
    base.add_special_tokens(["<bos>", "<start_of_turn>", "<end_of_turn>"])
    if post_processor:
        bos = base.token_to_id("<bos>")
        base.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
    base.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                "chat_template": TEMPLATE} | config
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    ends = [base.token_to_id("<|endoftext|>"), base.token_to_id("<end_of_turn>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return ChatTokenizer.load(folder)


@pytest.mark.parametrize(("post_processor", "config"), [
    (True, {}),  # Gemma 3's folder: the post-processor adds it, the config is silent
    (True, {"bos_token": "<bos>"}),
    (False, {"bos_token": "<bos>"}),  # nothing adds it
    # the generic class: transformers reads BOS from the post-processor alone
    (False, {"bos_token": "<bos>", "add_bos_token": True}),
])
def test_prompt_ids_equal_transformers(tmp_path, post_processor, config):
    transformers = pytest.importorskip("transformers")
    ours = _folder(tmp_path, post_processor, config)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ("The capital of France is", " the  Rome\n"):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.add_bos == post_processor
    assert (ours.encode("the")[0] == ours.bos_id) == post_processor


def test_a_chat_template_that_writes_bos_gets_it_once(tmp_path):
    ours = _folder(tmp_path, True, {})
    ids = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids.count(ours.bos_id) == 1 and ids[0] == ours.bos_id
    assert ours.encode("<bos>hi") == ours.encode("hi")  # a prompt that writes it: once


def test_generation_config_end_ids_end_a_reply(tmp_path):
    ours = _folder(tmp_path, True, {})
    turn_end = ours.tokenizer.token_to_id("<end_of_turn>")
    assert eos_ids(GenerationConfig(), ours) == {ours.eos_id, turn_end}
    assert eos_ids(GenerationConfig(eos_ids=()), ours) == set()
    (tmp_path / "again").mkdir()
    ours.save(tmp_path / "again" / "tokenizer.json")
    again = ChatTokenizer.load(tmp_path / "again")
    assert again.end_ids == ours.end_ids and again.add_bos and again.specials == ours.specials


def test_a_saved_tokenizer_that_adds_bos_reads_back_the_same_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = _folder(tmp_path, False, {"bos_token": "<bos>"})
    ours.add_bos = True  # as a GGUF SentencePiece vocabulary says
    (tmp_path / "saved").mkdir()
    ours.save(tmp_path / "saved" / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    again = ChatTokenizer.load(tmp_path / "saved")
    text = "The capital of France is"
    assert again.encode(text) == theirs(text)["input_ids"] == ours.encode(text)
    assert ours.encode(text)[0] == ours.bos_id
