"""``models/gguf_header.read_gguf_header`` reads what ``gguf.GGUFReader`` reads (scalars, strings,
array lengths, the tensor table), value for value, on files the ``gguf`` library writes; and
refuses what is not a GGUF header it can read, naming the file."""
import math

import pytest

from flowrl.models.gguf_header import GGUFArray, read_gguf_header


def _write(path, *, tokens=40):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(16)
    w.add_block_count(2)
    w.add_context_length(2048)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(32)
    w.add_layer_norm_rms_eps(1e-5)          # float32
    w.add_bool("test.flag", True)
    w.add_int8("test.i8", -7)
    w.add_uint16("test.u16", 65535)
    w.add_int64("test.i64", -(2**40))
    w.add_float64("test.f64", 0.125)
    w.add_string("test.name", "héllo wörld")  # UTF-8 beyond ASCII
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" * (i % 5 + 1) for i in range(tokens)])  # strings of many lengths
    w.add_token_types([1] * tokens)           # an int32 array
    w.add_array("test.floats", [0.5, 1.5, 2.5])
    w.add_tensor("token_embd.weight", np.zeros((tokens, 16), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_header_matches_the_gguf_librarys_reader(tmp_path):
    import gguf

    _write(tmp_path / "m.gguf")
    got = read_gguf_header(str(tmp_path / "m.gguf"))
    ref = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert got.version == 3
    # every key, in file order (the library adds GGUF.version, .tensor_count, .kv_count of its own)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(got.fields) == list(ref_fields)
    for key, f in ref_fields.items():
        value = got.fields[key]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            assert value == GGUFArray(int(f.types[1]), len(f.contents())), key
        elif isinstance(value, float):
            assert value == pytest.approx(f.contents(), rel=1e-7), key
        else:
            assert value == f.contents(), key
    assert got.tensors == {t.name: tuple(int(d) for d in t.shape) for t in ref.tensors}
    assert got.n_elements() == sum(int(t.n_elements) for t in ref.tensors) == 40 * 16 + 256 + 16
    # exact values, so a wrong offset anywhere above would show
    assert got.fields["test.name"] == "héllo wörld" and got.fields["test.i64"] == -(2**40)
    assert got.fields["tokenizer.ggml.tokens"] == GGUFArray(8, 40)
    assert got.fields["llama.context_length"] == 2048
    assert got.tensors["token_embd.weight"] == (16, 40)  # fastest-varying dimension first


def test_model_size_of_a_gguf_reads_its_header_only(tmp_path):
    """models.size reads the parameter count, attention shape, vocabulary and context length from
    the header; math.prod of the shapes is the parameter count."""
    from flowrl.models.loading import ModelConfig
    from flowrl.models.size import model_size

    _write(tmp_path / "m.gguf", tokens=48)
    m = model_size(ModelConfig(path=str(tmp_path), gguf_file="m.gguf"))
    assert (m.n_params, m.n_layers, m.n_heads, m.head_dim, m.vocab_size, m.max_positions,
            m.tied_embeddings) == (48 * 16 + 256 + 16, 2, 4, 4, 48, 2048, True)
    assert math.prod((48, 16)) + 256 + 16 == m.n_params


@pytest.mark.parametrize("content, match", [
    (b"GGML" + b"\0" * 20, "is not a GGUF file"),
    (b"", "shorter than a GGUF header"),
    (b"GGUF" + (1).to_bytes(4, "little") + b"\0" * 16, "GGUF version 1"),
    (b"GGUF" + (3).to_bytes(4, "big") + b"\0" * 16, "big-endian GGUF"),
    (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little"),
     "header ends early"),
])
def test_refuses_what_it_cannot_read_naming_the_file(tmp_path, content, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        read_gguf_header(str(p))
    assert str(p) in str(e.value)


def test_a_cut_file_is_refused_not_misread(tmp_path):
    _write(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])  # inside the token list
    with pytest.raises(ValueError, match="cut.gguf"):
        read_gguf_header(str(tmp_path / "cut.gguf"))


@pytest.mark.slow
def test_the_bundled_smollm2_header_matches_the_gguf_library():
    """The real file (its tokenizer is what made gguf.GGUFReader slow): the same ModelSize."""
    import gguf

    from flowrl.models.loading import SMOLLM2_GGUF, smollm2_dir

    path = str(smollm2_dir() / SMOLLM2_GGUF)
    got, ref = read_gguf_header(path), gguf.GGUFReader(path)
    assert got.tensors == {t.name: tuple(int(d) for d in t.shape) for t in ref.tensors}
    assert got.fields["tokenizer.ggml.tokens"].count == len(ref.fields["tokenizer.ggml.tokens"].contents())
    assert got.fields["llama.context_length"] == ref.fields["llama.context_length"].contents()


def test_a_users_empty_gguf_is_refused_before_anything_loads(tmp_path):
    """Fresh-user report: an empty model.gguf_file beside tokenizer files passed the input checks
    and `flowrl train` ended in a transformers traceback; the header check names the file."""
    from flowrl.models.loading import check_model_dir

    (tmp_path / "x.gguf").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model.gguf_file 'x.gguf': .*x.gguf is not a GGUF file"):
        check_model_dir(tmp_path, "x.gguf", tokenizer=True)
    _write(tmp_path / "ok.gguf")
    check_model_dir(tmp_path, "ok.gguf", tokenizer=True)  # a readable header passes
