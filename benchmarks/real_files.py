"""Real model files as users download them, made by llama.cpp's own tools, checked against
llama.cpp and transformers.

Three tiny Hugging Face folders (random weights from transformers' config classes, real
tokenizers):
- spm: a Llama with a SentencePiece tokenizer trained by `sentencepiece` on tinyshakespeare;
- llama3: a Llama with Llama 3's vocabulary (from llama.cpp's ggml-vocab-llama-bpe.gguf) and
  Llama 3.1's RoPE bands (`rope_scaling` llama3, written by the converter as rope_freqs);
- qwen2: a Qwen2 with Qwen2's vocabulary.
Each is converted by llama.cpp's `convert_hf_to_gguf.py` (f32) and quantized by
`llama-quantize` to Q4_K_M, Q5_K_M, Q6_K and Q8_0. Then, for each file:
- token ids: Glassformer's (BOS as the file says) against `llama-tokenize` over hard strings;
- `glassformer compare` at every place, of the folder and of the f32 GGUF (transformers reads
  no `rope_freqs` from a GGUF, so the Llama 3 file's comparison is reported, not required: its
  greedy tokens are held to transformers on the folder instead);
- greedy tokens: Glassformer from the f32 GGUF (one sequence and the serving engine) and from
  the folder against transformers on the folder (required equal); from each quantized file,
  Glassformer's default load (float32) beside `--quantize gguf` (its blocks kept; how many
  tokens agree is reported).

    python benchmarks/real_files.py --llama-cpp PATH/llama.cpp [--out DIR] [--json]

PATH/llama.cpp is llama.cpp's source with `build/bin/llama-quantize` and `llama-tokenize`
built (see ../shared/ANCHORS.md: both come in llama-cpp-python's source archive on PyPI).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_binaries
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from glassformer import load  # noqa: E402
from glassformer.data import tinyshakespeare  # noqa: E402
from glassformer.formats.gguf_file import GGUFFile  # noqa: E402
from glassformer.formats.gguf_tokenizer import from_gguf_metadata  # noqa: E402

QUANTS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
PROMPT = "The capital of France is"
HARD = ["Hello world", " Hello world", "  leading spaces", "tabs\tand\nnewlines\n\n\n",
        "digits 1234567890 and 3.14159", "accents: café naïve résumé Ærøskøbing",
        "CJK: 你好，世界 こんにちは 안녕하세요", "emoji: 🦙🔥 👍🏽", "bytes \u0007\u001b ok",
        "don't won't I'll we've", "   ", "a" * 40, "</s> inside <s> text"]
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.05)


def spm_folder(folder: Path, corpus: Path) -> None:
    import sentencepiece
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=1000,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    settings = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", "add_bos_token": True}  # as Llama 2's folders
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    _model(folder, transformers.LlamaConfig(vocab_size=1000, bos_token_id=1, eos_token_id=2, **SHAPE),
           transformers.LlamaForCausalLM)


def vocab_folder(folder: Path, vocab: Path, family: str) -> None:
    """A folder with the real vocabulary of one of llama.cpp's ggml-vocab files."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    with GGUFFile(vocab) as file:
        tokenizer = from_gguf_metadata(file.metadata)
    tokenizer.save(folder / "tokenizer.json")
    ids = dict(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
               eos_token_id=tokenizer.eos_id)
    if family == "llama3":
        config = transformers.LlamaConfig(**ids, **SHAPE, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        _model(folder, config, transformers.LlamaForCausalLM)
    else:
        _model(folder, transformers.Qwen2Config(**ids, **SHAPE), transformers.Qwen2ForCausalLM)


def _model(folder: Path, config, kind) -> None:
    torch.manual_seed(0)
    model = kind(config).eval()
    model.save_pretrained(folder)


def compare_ok(model: Path) -> bool:
    """Whether `glassformer compare` finds every place within tolerance (it exits 1 where not)."""
    done = subprocess.run([sys.executable, "-m", "glassformer", "compare", "--model", str(model),
                           "--json", PROMPT], capture_output=True, text=True)
    return json.loads(done.stdout)["ok"]


def llama_cpp_ids(tool: Path, gguf: Path, text: str) -> list[int]:
    out = llama_binaries.run([str(tool), "-m", str(gguf), "-p", text, "--ids", "--log-disable"])
    return json.loads(out.strip().splitlines()[-1])


def greedy(source, n: int = 16, engine: bool = False, **load_options) -> list[int]:
    """Greedy tokens from one sequence's decode, or from the serving engine's."""
    model = load(str(source), progress=False, **load_options)
    if engine:
        return model.generate_many([PROMPT], max_new_tokens=n, eos_ids=())[0].generated_ids
    return model.generate(PROMPT, max_new_tokens=n, eos_ids=()).generated_ids


def transformers_greedy(folder: Path, n: int = 16) -> list[int]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def check_family(name: str, folder: Path, llama_cpp: Path, out: Path) -> dict:
    f32 = llama_binaries.convert_hf(llama_cpp, folder, out / f"{name}.f32.gguf", "f32")
    files = {"f32": f32}
    for quant in QUANTS:
        files[quant] = llama_binaries.quantize(llama_cpp / "build/bin", f32,
                                               out / f"{name}.{quant}.gguf", quant)
    tool = llama_cpp / "build/bin/llama-tokenize"
    ours = load(str(f32)).tokenizer
    token_errors = [text for text in HARD if ours.encode(text) != llama_cpp_ids(tool, f32, text)]
    compare = {source: compare_ok(path) for source, path in (("folder", folder), ("f32_gguf", f32))}
    reference = transformers_greedy(folder)
    report = {"tokenizer_mismatches": token_errors, "compare_ok": compare, "transformers": reference,
              "glassformer_folder": greedy(folder), "glassformer_f32_gguf": greedy(f32),
              "glassformer_engine_f32_gguf": greedy(f32, engine=True)}
    for quant in QUANTS:
        report[quant] = {"dequantized": greedy(files[quant]),
                         "kept": greedy(files[quant], quantize="gguf")}
        pairs = zip(report[quant]["dequantized"], report[quant]["kept"], strict=True)
        report[quant]["same_prefix"] = next((i for i, (a, b) in enumerate(pairs) if a != b), 16)
    # the kept blocks round activations to int8 as llama.cpp does: their tokens part from the
    # float32 dequantized ones where random weights leave near ties; reported, not required
    report["ok"] = (not token_errors and compare["folder"] and report["glassformer_folder"] == reference
                    == report["glassformer_f32_gguf"] == report["glassformer_engine_f32_gguf"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source, built")
    parser.add_argument("--out", type=Path, default=None, help="keep the files here")
    parser.add_argument("--only", nargs="*", default=["spm", "llama3", "qwen2"])
    parser.add_argument("--corpus", type=Path, default=tinyshakespeare(),
                        help="text the SentencePiece tokenizer is trained on")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="glassformer-real-"))
    out.mkdir(parents=True, exist_ok=True)
    vocabs = args.llama_cpp / "models"
    builders = {"spm": lambda f: spm_folder(f, args.corpus),
                "llama3": lambda f: vocab_folder(f, vocabs / "ggml-vocab-llama-bpe.gguf", "llama3"),
                "qwen2": lambda f: vocab_folder(f, vocabs / "ggml-vocab-qwen2.gguf", "qwen2")}
    results = {}
    for name in args.only:
        folder = out / f"{name}-hf"
        builders[name](folder)
        results[name] = check_family(name, folder, args.llama_cpp, out)
        if not args.json:
            print(f"{name}: {'ok' if results[name]['ok'] else 'MISMATCH'} "
                  f"{json.dumps(results[name])}", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
