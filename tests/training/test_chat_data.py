"""Chat fine-tuning data: the loss mask against the template's own layout, the document mask
against each conversation run alone (module path and fused training passes), the loss against
a manual cross-entropy, the command end to end on a tiny Llama, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from llama_folder import chat_llama_folder

from glassformer.accel.fast_training import use_fast_training
from glassformer.cli import main
from glassformer.formats.chat_tokenizer import ChatTokenizer
from glassformer.formats.checkpoint import load_model
from glassformer.formats.huggingface import load_hf
from glassformer.model.config import ModelConfig
from glassformer.model.layers.attention_backends import sdpa_attention
from glassformer.model.transformer import Transformer
from glassformer.training.chat_data import ChatSFT, pack, read_conversations, render
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train
from glassformer.training.masking import IGNORE

# a short template in ChatML's manner (turns marked by role, each ended by a newline), so that
# conversations fit the tiny model's 64 positions
TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox?"},
     {"role": "assistant", "content": "jumps over the dog."},
     {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "pack my box."}],
    [{"role": "user", "content": "five dozen"}, {"role": "assistant", "content": "jugs"}],
    [{"role": "user", "content": "lazy dog"}, {"role": "assistant", "content": "the brown fox"}],
    [{"role": "user", "content": "over"}, {"role": "assistant", "content": "the quick box"}],
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-llama")
    chat_llama_folder(folder, TEMPLATE)
    return folder


@pytest.fixture()
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 3))
    return path


def test_loss_mask_covers_exactly_the_assistant_turns(chat_model):
    tokenizer = ChatTokenizer.load(chat_model)
    for messages in CONVERSATIONS:
        c = render(tokenizer, messages)
        assert tokenizer.decode(c.ids) == tokenizer.render_chat(messages, add_generation_prompt=False)
        runs, run = [], []  # the counted tokens, run by run
        for token, counted in zip(c.ids, c.counted, strict=True):
            if counted:
                run.append(token)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(r) for r in runs] == [f"{r}\n" for r in replies]


def _tiny(seed=0):
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=50, context_length=32, d_model=32, n_layers=2, n_heads=4,
                         n_kv_heads=2, position="rope", norm="rmsnorm", activation="silu",
                         gated=True, attn_bias=False, mlp_bias=False)
    return Transformer(config).eval()


@pytest.mark.parametrize("fast", [False, True])
def test_packed_logits_equal_each_conversation_alone(fast, request):
    model = _tiny()
    if fast:
        request.getfixturevalue("kernels")  # skips where the C++ kernels cannot be built
        model = use_fast_training(model).train()  # the fused passes take training's calls
        assert model.blocks[0].attn.kernel is not sdpa_attention
    lengths, generator = [7, 12, 5], torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 50, (n,), generator=generator) for n in lengths]
    ids = torch.cat(docs)[None]  # (1, 24)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.enable_grad():
        packed = model(ids, positions=positions, documents=documents)  # (1, 24, vocab)
        alone = torch.cat([model(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    # without the document mask the later conversations would see the earlier ones
    assert not torch.allclose(model(ids, positions=positions), alone, atol=1e-3)


def test_loss_counts_the_assistant_targets_only(chat_model):
    tokenizer = ChatTokenizer.load(chat_model)
    conversations = [render(tokenizer, m) for m in CONVERSATIONS]
    rows = pack(conversations, 60, tokenizer.eos_id)
    model = _tiny_for(tokenizer.vocab_size)
    batch = rows.batch(torch.arange(len(rows)))
    got = ChatSFT().loss(model, batch)

    # oracle: each conversation alone, cross-entropy over the assistant tokens it predicts
    losses = []
    for c in conversations:
        ids = torch.tensor(c.ids[:61])
        logits = model(ids[None, :-1])[0]  # (n-1, vocab)
        counted = torch.tensor(c.counted[1:61])
        losses.append(F.cross_entropy(logits[counted], ids[1:][counted], reduction="none"))
    torch.testing.assert_close(got, torch.cat(losses).mean(), atol=1e-5, rtol=1e-5)
    assert (batch[-1] != IGNORE).sum() == sum(len(x) for x in losses)


def _tiny_for(vocab_size):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab_size, context_length=64, d_model=32, n_layers=1,
                         n_heads=4, position="rope", norm="rmsnorm", activation="silu", gated=True)
    return Transformer(config).eval()


def test_train_command_on_chat_data(chat_model, chat_file, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--init", str(chat_model), "--data", str(chat_file), "--out", str(out),
                 "--context-length", "48", "--batch-size", "2", "--max-iters", "3",
                 "--eval-interval", "3", "--eval-iters", "1", "--warmup-iters", "0",
                 "--sample-tokens", "0", "--device", "cpu", "--json", "--no-progress"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["iters"] == 3 and summary["val_loss"] == summary["val_loss"]
    assert (out / "latest" / "model.safetensors").is_file()
    base, _ = load_hf(chat_model)
    tuned, tokenizer, _ = load_model(out / "latest")
    assert tokenizer.chat_template == TEMPLATE  # the run keeps the model's template
    assert not torch.equal(tuned.lm_head.weight, base.lm_head.weight)  # it trained


def test_first_evaluation_is_the_manual_loss(chat_model, chat_file, tmp_path):
    frozen = TrainConfig(init=str(chat_model), lr=0.0, min_lr=0.0, max_iters=1, eval_interval=1,
                         eval_iters=4, batch_size=2, warmup_iters=0, sample_tokens=0, device="cpu")
    summary = train(chat_file, tmp_path / "run", {"context_length": 48}, frozen, progress=False)
    model, tokenizer = load_hf(chat_model)
    val = [render(tokenizer, m) for m in read_conversations(chat_file)][-1:]  # 10% of 12 -> 1
    ids = torch.tensor(val[0].ids)
    counted = torch.tensor(val[0].counted[1:])
    logits = model(ids[None, :-1])[0]
    expected = F.cross_entropy(logits[counted], ids[1:][counted]).item()
    assert summary["val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("line, message", [
    ("{not json", "chat.jsonl:2: not valid JSON"),
    ('{"text": "hi"}', 'chat.jsonl:2: expected {"messages"'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "chat.jsonl:2: messages[0].role"),
    ('{"messages": [{"role": "user", "content": 3}]}', "chat.jsonl:2: messages[0].content"),
])
def test_a_malformed_line_is_named(tmp_path, line, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
        read_conversations(path)


def test_command_refusals_leave_nothing(chat_model, tmp_path, capsys):
    no_replies = tmp_path / "users.jsonl"
    no_replies.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n[1, 2]\n")
    cases = [
        (["--init", str(chat_model), "--data", str(no_replies)], "users.jsonl: no assistant turns"),
        (["--init", str(chat_model), "--data", str(bad)], "bad.jsonl:2: expected"),
        (["--preset", "tiny-llama", "--data", str(bad)], "chat data (.jsonl) fine-tunes a pretrained"),
    ]
    for args, message in cases:
        out = tmp_path / "run"
        code = main(["train", *args, "--out", str(out), "--max-iters", "1", "--device", "cpu"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_chat_run_resumes_exactly(chat_model, chat_file, tmp_path):
    config = TrainConfig(init=str(chat_model), max_iters=4, eval_interval=2, eval_iters=1,
                         batch_size=2, warmup_iters=0, sample_tokens=0, device="cpu", lr=1e-3,
                         lr_decay_iters=4)
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(chat_file, whole, {"context_length": 48}, config, progress=False)
    train(chat_file, split, {"context_length": 48}, config.replace(max_iters=2), progress=False)
    train(chat_file, split, {"context_length": 48}, config, resume=True, progress=False)
    a, b = load_model(whole / "latest")[0], load_model(split / "latest")[0]
    for name, value in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], value, rtol=0, atol=0)
