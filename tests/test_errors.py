"""Bad input gets one clear error and loses nothing."""

import json
import os
import shutil
import signal
import struct

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from pwctl.build.convert import ConvertOptions, convert
from pwctl.cli import app
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack

runner = CliRunner()


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def test_missing_source(tmp_path):
    with pytest.raises(PwctlError, match="no such checkpoint folder"):
        convert(tmp_path / "nope", tmp_path / "out", ConvertOptions())


def test_error_lines_keep_their_brackets(tmp_path):
    # rich would read "[plot]" as markup and drop it (the CLI printed "pip install 'pwctl'")
    missing = tmp_path / "run[plot]" / "pack"
    r = runner.invoke(app, ["generate", str(missing), "--prompt", "hi"])
    assert r.exit_code == 2 and "run[plot]" in r.output


def test_unsupported_architecture(checkpoints, tmp_path):
    src = copy(checkpoints[("mixtral", "fused")], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(PwctlError, match="unsupported architecture 'llama'.*mixtral.*olmoe"):
        convert(src, tmp_path / "out", ConvertOptions())
    assert_nothing_written(tmp_path / "out")


def test_truncated_shard(checkpoints, tmp_path):
    src = copy(checkpoints[("mixtral", "per_expert")], tmp_path / "src")
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(PwctlError, match="model.safetensors: truncated shard"):
        convert(src, tmp_path / "out", ConvertOptions())
    assert_nothing_written(tmp_path / "out")


def test_missing_shard_of_an_index(checkpoints, tmp_path):
    src = copy(checkpoints[("olmoe", "per_expert")], tmp_path / "src")
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PwctlError, match="model-00002-of-00002.safetensors: shard missing"):
        convert(src, tmp_path / "out", ConvertOptions())


def _rewrite(src, name, fn):
    from safetensors.torch import load_file

    state = load_file(src / "model.safetensors")
    state[name] = fn(state[name])
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})


def test_unexpected_shape(checkpoints, tmp_path):
    src = copy(checkpoints[("qwen3_moe", "per_expert")], tmp_path / "src")
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    _rewrite(src, name, lambda t: t[:-1])
    with pytest.raises(PwctlError, match=f"tensor {name} has shape"):
        convert(src, tmp_path / "out", ConvertOptions())
    assert_nothing_written(tmp_path / "out")


def test_unexpected_dtype(checkpoints, tmp_path):
    src = copy(checkpoints[("mixtral", "fused")], tmp_path / "src")
    name = "model.layers.0.mlp.experts.down_proj"
    _rewrite(src, name, lambda t: t.to(torch.int8))
    with pytest.raises(PwctlError, match=f"tensor {name} has dtype I8"):
        convert(src, tmp_path / "out", ConvertOptions())


def leftovers(folder):
    """Hidden temporary or backup entries a conversion left next to its output."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_refuses_to_overwrite_without_force(checkpoints, tmp_path):
    out = tmp_path / "out"
    convert(checkpoints[("olmoe", "fused")], out, ConvertOptions(max_bits=4))
    with pytest.raises(PwctlError, match="exists; pass --force"):
        convert(checkpoints[("olmoe", "fused")], out, ConvertOptions())
    assert Pack(out).manifest.max_bits == 4
    convert(checkpoints[("olmoe", "fused")], out, ConvertOptions(max_bits=3, force=True))
    assert Pack(out).manifest.max_bits == 3 and leftovers(tmp_path) == []


def test_force_never_replaces_what_is_not_a_pack(checkpoints, tmp_path):
    folder, file = tmp_path / "mine", tmp_path / "notes.txt"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    file.write_text("also mine")
    src = str(checkpoints[("olmoe", "fused")])
    for out in (folder, file):
        r = runner.invoke(app, ["convert", src, str(out), "--force"])
        assert r.exit_code == 2 and "is not a pwctl pack" in r.output, r.output
        assert "Traceback" not in r.output
    assert (folder / "keep.txt").read_text() == "mine" and file.read_text() == "also mine"
    assert leftovers(tmp_path) == []


def test_exchange_swaps_two_folders(tmp_path):
    from pwctl.format.pack import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("from a")
    (b / "x").write_text("from b")
    exchange(a, b)
    assert (a / "x").read_text() == "from b" and (b / "x").read_text() == "from a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_conversion_leaves_nothing(sig, checkpoints, tmp_path, monkeypatch):
    """The command, signalled while it quantizes, removes its temporary folder on SIGTERM as on
    SIGINT, and a pack it was replacing stays whole."""
    import pwctl.build.convert as conv

    src, out = checkpoints[("mixtral", "fused")], tmp_path / "out"
    convert(src, out, ConvertOptions(max_bits=4))
    real = conv.quantize_block
    calls = []

    def signalled(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), sig)
        return real(*a, **k)

    monkeypatch.setattr(conv, "quantize_block", signalled)
    r = runner.invoke(app, ["convert", str(src), str(out), "--force"])
    assert r.exit_code == 128 + sig, r.output  # as the shell reports a signalled process
    assert leftovers(tmp_path) == [] and Pack(out).manifest.max_bits == 4


def test_interrupted_conversion_leaves_no_pack(checkpoints, tmp_path, monkeypatch):
    import pwctl.build.convert as conv

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "quantize_block", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(checkpoints[("mixtral", "fused")], tmp_path / "out", ConvertOptions())
    assert_nothing_written(tmp_path / "out")


def test_corrupt_plane_is_detected(packs, tmp_path):
    pack_dir = copy(packs[("mixtral", "fused")], tmp_path / "pack")
    pack = Pack(pack_dir)
    block = pack.blocks[5]
    page = pack_dir / block.file
    data = bytearray(page.read_bytes())
    data[block.planes[2].offset + 3] ^= 0xFF
    page.write_bytes(bytes(data))
    with pytest.raises(PwctlError, match=f"checksum mismatch in {block.name} plane 2"):
        pack.read_plane(block, 2)


def test_not_a_pack(tmp_path):
    with pytest.raises(PwctlError, match="not a pwctl pack"):
        Pack(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(PwctlError, match="corrupt manifest"):
        Pack(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "pwctl-pack", "version": 1}')
    with pytest.raises(PwctlError, match="pack format v1, this pwctl reads v2; convert the model"):
        Pack(tmp_path)  # row-major planes (before the tiled layout): converted again, not misread


def test_safetensors_header_garbage(tmp_path):
    from pwctl.build.checkpoint import read_header

    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(PwctlError, match="truncated or corrupt"):
        read_header(bad)


@pytest.mark.parametrize(
    "args,message",
    [
        (["convert", "/nonexistent/src", "/tmp/x"], "no such checkpoint folder"),
        (["generate", "/nonexistent/pack", "--prompt", "hi"], "no such pack"),
        (["bench", "/nonexistent/pack", "--ppl"], "no such pack"),
        (["generate", "/tmp", "--prompt", "hi", "--policy", "uniform:12"], "uniform:B needs B"),
        (["bench", "/tmp", "--ppl", "--policy", "pagedweight:1.5"], "fraction must be in"),
    ],
)
def test_cli_errors_are_one_line(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_serve_and_kernel_bench_refuse_cleanly():
    cases = [
        (["serve", "/nonexistent/pack"], "no such pack"),
        (["serve", "/nonexistent/pack", "--memory-budget", "lots"], "--memory-budget 'lots'"),
        (["serve", "/nonexistent/pack", "--port", "70000"], "--port"),
        # bench --kernels' arguments are checked before it looks for a GPU
        (["bench", "x", "--kernels", "--shape", "llama"], "unknown --shape ['llama']"),
        (["bench", "x", "--kernels", "--width", "9"], "bad --width '9': a width in 2..8"),
        (["bench", "x", "--kernels", "--width", "four"], "bad --width 'four'"),
        (["bench", "x", "--kernels", "--tokens", "0"], "bad --tokens 0"),
    ]
    if not torch.cuda.is_available():
        cases.append((["bench", "x", "--kernels"], "needs a CUDA device"))
    for cmd, message in cases:
        result = runner.invoke(app, cmd)
        assert result.exit_code == 2 and message in result.output, (cmd, result.output)


def _flip_reference_byte(pack_dir, name: str) -> None:
    """Flip one byte inside tensor `name` of reference.safetensors."""
    path = pack_dir / "reference.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    start, _ = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    data[8 + n + start + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_generate_verifies_every_plane_even_under_fp16(packs, tmp_path):
    """fp16 reads only the reference weights, yet a corrupt plane fails generate (it exited 0);
    --no-verify skips the check explicitly."""
    pack_dir = copy(packs[("mixtral", "fused")], tmp_path / "pack")
    block = _flip_plane_byte(pack_dir, 5, 2)
    args = ["generate", str(pack_dir), "--prompt", "The earth", "--max-tokens", "2"]
    args += ["--policy", "fp16"]  # reads only the reference weights
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and f"{block.name} plane 2: checksum mismatch" in r.output, r.output
    assert runner.invoke(app, [*args, "--no-verify"]).exit_code == 0


def test_reference_weights_carry_checksums(packs, tmp_path):
    pack_dir = copy(packs[("qwen2_moe", "per_expert")], tmp_path / "pack")
    pack = Pack(pack_dir)
    assert all(b.reference_crc32 is not None for b in pack.blocks) and pack.verify() == []
    block = pack.blocks[4]
    _flip_reference_byte(pack_dir, block.name)
    seen = []
    faults = Pack(pack_dir).verify(lambda done, total: seen.append((done, total)))
    assert [(f.block, f.plane) for f in faults] == [(block.name, None)]
    assert seen[-1][0] == seen[-1][1] and len(seen) == len(pack.blocks)
    args = ["generate", str(pack_dir), "--prompt", "The earth", "--max-tokens", "2"]
    args += ["--policy", "fp16"]  # reads only the reference weights
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and f"{block.name} reference weights" in r.output, r.output
    r = runner.invoke(app, [*args, "--no-verify"])  # found when fp16 loads them: no output
    assert r.exit_code == 2 and "reference weights failed their checksum" in r.output, r.output


def test_a_bad_plane_found_on_first_use_caps_its_block(packs, tmp_path):
    """Without a verification pass, the read that loads a block's planes finds the bad one:
    the block runs at its last good width, and the fault is recorded."""
    from pwctl.policy import parse_policy
    from pwctl.runtime.engine.engine import Engine

    pack_dir = copy(packs[("olmoe", "fused")], tmp_path / "pack")
    block = _flip_plane_byte(pack_dir, 2, 5)
    engine = Engine(Pack(pack_dir))
    engine.set_policy(parse_policy("uniform:7"))
    assert torch.equal(engine.store.weight(2), engine.store.weight_at(2, 5))
    assert [(f.block, f.plane) for f in engine.store.faults] == [(block.name, 5)]
    assert engine.store.served_width(2) == 5 and engine.store.served_width(3) == 7
    with pytest.raises(PwctlError, match="bad checksum"):
        engine.store.weight_at(2, 6)


def _flip_plane_byte(pack_dir, index: int, plane: int):
    """Corrupt one byte of plane `plane` of block `index` in its page file; the block."""
    block = Pack(pack_dir).blocks[index]
    page = pack_dir / block.file
    data = bytearray(page.read_bytes())
    data[block.planes[plane].offset + 3] ^= 0xFF
    page.write_bytes(bytes(data))
    return block
