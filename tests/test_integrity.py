"""Security and data integrity with hostile and careless inputs: checkpoints that try to run code, two runs on one
run dir, resumes that would change the data, index files that disagree with their data, bad preprocessing input,
non-finite streaks, and user-caused conditions that must be one line (no traceback). Real files and processes."""

from __future__ import annotations

import hashlib
import io
import json
import re
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, launcher, run_cli, user_env
from hybridpar.checkpoint.dcp import load_full_model_state
from hybridpar.checkpoint.layout import checkpoint_dir, latest_checkpoint
from hybridpar.errors import CheckpointError, DataError, RunDirError
from hybridpar.checkpoint.resume_checks import read_checkpoint_config
from hybridpar.checkpoint.run_dir import LOCK, RunDirLock
from hybridpar.checkpoint.safe_load import read_metadata

COMMON = ["--train.global_batch_size", "8", "--train.seq_len", "64", "--logging.interval", "1",
          "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.precision", "fp32",
          "--checkpoint.interval", "2", "--checkpoint.keep_last", "2", "--logging.wandb.mode", "disabled"]


def _args(cache_dir, run_dir, steps, *extra):
    return ["launch/pretrain_gpt.py", "--train.steps", str(steps), *COMMON, "--data.cache_dir", str(cache_dir),
            "--run.dir", str(run_dir), *extra]


def _tree(d: Path) -> dict[str, str]:
    """Every file under d with the sha256 of its bytes: 'left as it was' means this is unchanged."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def _one_line_error(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir) -> Path:
    """A run of 4 steps with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    out = run_cli(_args(cache_dir, run_dir, 4))
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _copy_run(trained: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


# -- 1. nothing in a checkpoint runs code ------------------------------------------------------------------------
class _Reduce:
    """Unpickling calls open(marker, "w"): the file appearing means code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dotted_payload(marker: Path) -> bytes:
    """Protocol 4 resolves a dotted global attribute by attribute: (allowed module, "os.system") reaches os.system
    through the module's own `import os`."""
    cmd = f"touch {marker}".encode()
    return (b"\x80\x04" + b"ctorch.distributed.checkpoint.metadata\nos.system\n"
            + b"(X" + len(cmd).to_bytes(4, "little") + cmd + b"tR.")


def _nested_payload(metadata_file: Path, marker: Path) -> bytes:
    """The real metadata, with one storage record replaced by an object whose unpickling runs code."""
    md = pickle.loads(metadata_file.read_bytes())
    key = next(iter(md.storage_data))
    md.storage_data[key] = _Reduce(str(marker))
    return pickle.dumps(md, protocol=4)


def _reduce_payload(marker: Path) -> bytes:
    return pickle.dumps(_Reduce(str(marker)))


PAYLOADS = {"dotted-global": lambda f, m: _dotted_payload(m), "reduce": lambda f, m: _reduce_payload(m),
            "nested-in-metadata": _nested_payload}


def _poison_metadata(ckpt: Path, kind: str, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(PAYLOADS[kind](ckpt / ".metadata", marker))


def _poison_byte_entry(ckpt: Path, key: str, marker: Path) -> None:
    """Point byte entry `key` (declared BytesStorageMetadata, as DCP stores optimizer hyper-parameters) at a new
    shard holding a torch.save of an object whose unpickling runs code; DCP's own planner would torch.load it with
    weights_only=False."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    buf = io.BytesIO()
    torch.save(_Reduce(str(marker)), buf)
    (ckpt / "__9_0.distcp").write_bytes(buf.getvalue())
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", 0, len(buf.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_poisoned_metadata_is_refused_by_every_reader(kind, trained, tmp_path):
    sys.path.insert(0, str(ROOT / "launch"))
    import convert_checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(trained, 4), ckpt)
    marker = tmp_path / "code-ran"
    _poison_metadata(ckpt, kind, marker)
    with pytest.raises(CheckpointError, match="refusing to load it|damaged"):
        read_metadata(ckpt)
    with pytest.raises(CheckpointError):
        load_full_model_state(ckpt)
    for cmd in ("to-torch", "to-hf"):  # the converters' own entry points, in this process
        assert convert_checkpoint.cli([cmd, "--checkpoint", str(ckpt), "--out", str(tmp_path / cmd)]) == 2
        assert not (tmp_path / cmd).exists()
    for name, args in (("generate", [str(ckpt), "x"]), ("evaluate", [str(ckpt), "--tasks", "builtin:next-words"])):
        assert launcher(name).cli(args) == 2
    assert not marker.exists()


def test_byte_entries_are_unpickled_with_an_allow_list(trained, tmp_path):
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from hybridpar.checkpoint.safe_load import SafeEmptyLoadPlanner, SafeReader

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(trained, 4), ckpt)
    key = "optim.param_groups.0.lr"
    state: dict = {}  # the real hyper-parameter loads through the safe planner (a hand-checked value)
    _load_state_dict(state, storage_reader=SafeReader(str(ckpt)), planner=SafeEmptyLoadPlanner(keys={key}),
                     no_dist=True)
    assert state["optim"]["param_groups"][0]["lr"] == pytest.approx(3e-3 * 4 / 20)  # warmup 4 of 20 steps
    marker = tmp_path / "code-ran"
    _poison_byte_entry(ckpt, key, marker)
    with pytest.raises(BaseException) as err:
        _load_state_dict({}, storage_reader=SafeReader(str(ckpt)), planner=SafeEmptyLoadPlanner(keys={key}),
                         no_dist=True)
    assert "not plain data" in str(err.value) or "not plain data" in repr(getattr(err.value, "failures", ""))
    assert not marker.exists()
    # A model tensor declared as a byte entry is refused before anything is read.
    _poison_byte_entry(ckpt, "model.norm.weight", marker)
    with pytest.raises(CheckpointError, match="declares 'model.norm.weight' as BytesStorageMetadata"):
        read_metadata(ckpt)
    assert not marker.exists()


def test_shard_paths_and_lengths_are_checked(trained, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(trained, 4), ckpt)
    original = (ckpt / ".metadata").read_bytes()
    md = pickle.loads(original)
    key = next(iter(md.storage_data))
    # a path out of the checkpoint, and shard names with a directory in them (a search instead of a full match of
    # the shard-name pattern would let these through)
    for name in ("../../../etc/passwd", "../x/__0_0.distcp", "sub/__0_0.distcp", "__0_0.distcp/../../y"):
        md.storage_data[key] = _StorageInfo(name, 0, 10)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
        with pytest.raises(CheckpointError, match="not a shard file of this checkpoint"):
            read_metadata(ckpt)
    (ckpt / ".metadata").write_bytes(original)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"shard __0_0.distcp is truncated \(1000 bytes"):
        read_metadata(ckpt)
    shard.unlink()
    with pytest.raises(CheckpointError, match="is missing its shard __0_0.distcp"):
        read_metadata(ckpt)
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="has no .metadata file"):
        read_metadata(ckpt)



def test_declared_sizes_the_shards_do_not_back_and_damaged_shards(trained, tmp_path):
    """A .metadata whose tensor sizes or chunks lie (a loader would allocate the declared size whole: 10^12 rows
    tried to take terabytes), and a shard of the right length with garbage inside: one line from every reader,
    and no output left behind by the converter (nor its partial directory)."""
    sys.path.insert(0, str(ROOT / "launch"))
    import convert_checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(trained, 4), ckpt)
    original = (ckpt / ".metadata").read_bytes()
    key = "model.norm.weight"

    def lie(change):
        md = pickle.loads(original)
        change(md.state_dict_metadata[key], md)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))

    def grow(entry, md):
        entry.size = torch.Size([10 ** 12])

    def move_chunk(entry, md):
        entry.chunks[0].offsets = torch.Size([5])

    def short_storage(entry, md):
        index = next(i for i in md.storage_data if i.fqn == key)
        info = md.storage_data[index]
        md.storage_data[index] = type(info)(info.relative_path, info.offset, 100)

    for change, message in [(grow, r"declares 'model.norm.weight' of size \(1000000000000,\) .* but its chunks hold"),
                            (move_chunk, r"gives 'model.norm.weight' a chunk of .* at \(5,\), outside its size"),
                            (short_storage, r"declares 'model.norm.weight''s chunk at \(0,\) as .* its stored data is "
                                            r"100 bytes")]:
        lie(change)
        with pytest.raises(CheckpointError, match=message):
            read_metadata(ckpt)
        assert convert_checkpoint.cli(["to-torch", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    (ckpt / ".metadata").write_bytes(original)
    info = next(v for i, v in pickle.loads(original).storage_data.items() if i.fqn == key)
    shard = ckpt / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset:info.offset + 64] = bytes(64)  # garbage of the right length: the chunk's zip header gone
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"a shard's data cannot be read \((not a tensor|a damaged) record\)"):
        load_full_model_state(ckpt)
    for cmd in ("to-torch", "to-hf", "to-megatron"):
        assert convert_checkpoint.cli([cmd, "--checkpoint", str(ckpt), "--out", str(tmp_path / cmd)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_links_out_of_a_checkpoint_are_refused(trained, tmp_path):
    """A shard or .metadata that is a link leaving the checkpoint (to a copy elsewhere: the bytes are valid, the
    place is not), and a step directory that is a link, which is no save of the run."""
    from hybridpar.checkpoint.layout import latest_checkpoint

    ckpt, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    shutil.copytree(checkpoint_dir(trained, 4), ckpt)
    shutil.copytree(ckpt, outside)
    for name in (".metadata", "__0_0.distcp"):
        (ckpt / name).unlink()
        (ckpt / name).symlink_to(outside / name)
        with pytest.raises(CheckpointError, match=f"{re.escape(name)} is a link out of the checkpoint"):
            read_metadata(ckpt)
        (ckpt / name).unlink()
        shutil.copyfile(outside / name, ckpt / name)
    assert read_metadata(ckpt) is not None
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000009").symlink_to(ckpt, target_is_directory=True)
    assert latest_checkpoint(run) is None

@pytest.mark.parametrize("how", ["resume-dotted", "load-byte-entry"])
def test_poisoned_checkpoint_through_the_trainer(how, trained, tmp_path, cache_dir):
    run_dir = _copy_run(trained, tmp_path)
    marker = tmp_path / "code-ran"
    if how == "resume-dotted":  # auto-resume from the run's own latest checkpoint
        _poison_metadata(checkpoint_dir(run_dir, 4), "dotted-global", marker)
        before = _tree(run_dir)
        out = run_cli(_args(cache_dir, run_dir, 6))
        assert _tree(run_dir) == before  # refused before writing anything
        line = _one_line_error(out)
        assert "refusing to load it" in line or "not plain data" in line
    else:
        # --checkpoint.load into a new run dir, an optimizer hyper-parameter's byte entry poisoned: a resume reads
        # only the optimizer's tensors (its hyper-parameters are the run's own), so the entry is never unpickled
        # and the run trains on. (The safe reader refusing it where it is read: test_byte_entries_are_unpickled_with_an_allow_list.)
        _poison_byte_entry(checkpoint_dir(run_dir, 4), "optim.param_groups.0.lr", marker)
        out = run_cli(_args(cache_dir, tmp_path / "new", 6, "--checkpoint.load", str(checkpoint_dir(run_dir, 4))))
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"resuming from {checkpoint_dir(run_dir, 4)} (step 4" in out.stdout
    assert not marker.exists()


def test_python_tags_and_damaged_json_are_one_line_errors(trained, tmp_path):
    sys.path.insert(0, str(ROOT / "launch"))
    import convert_checkpoint

    from hybridpar.checkpoint.resume_checks import read_run_state

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(trained, 4), ckpt)
    marker = tmp_path / "code-ran"
    (ckpt / "config.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(CheckpointError, match="is not a config hybridpar wrote"):
        read_checkpoint_config(ckpt)
    assert convert_checkpoint.cli(["to-torch", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    assert not marker.exists() and not (tmp_path / "o").exists()
    (ckpt / "run_state.json").write_text('{"wandb_id": ')
    with pytest.raises(CheckpointError, match="run_state.json is damaged"):
        read_run_state(ckpt)
    for state, message in [({"wandb_id": 5}, "wandb_id is 5, not a non-empty string"),
                           ({"wandb_id": ""}, "wandb_id is '', not a non-empty string"),
                           ({"tokenizer_fingerprint": ["x"]}, r"tokenizer_fingerprint is \['x'\], not a non-empty string"),
                           ({"cpu_threads": "2"}, "cpu_threads is '2', not a positive int"),
                           ({"cpu_threads": True}, "cpu_threads is True, not a positive int"),
                           ({"cpu_threads": 0}, "cpu_threads is 0, not a positive int")]:
        (ckpt / "run_state.json").write_text(json.dumps(state))
        with pytest.raises(CheckpointError, match=f"run_state.json is damaged \\({message}\\)"):
            read_run_state(ckpt)
    (ckpt / "run_state.json").write_text(json.dumps({"wandb_id": None, "cpu_threads": 3}))
    assert read_run_state(ckpt) == {"wandb_id": None, "cpu_threads": 3}
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    assert convert_checkpoint.cli(["from-hf", "--hf", str(hf), "--out", str(tmp_path / "from")]) == 2
    assert not (tmp_path / "from").exists()


# -- 2. one run per run dir --------------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _write_lock(run_dir: Path, **fields) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": None, "started": "earlier",
              "slurm_job_id": None, "slurm_restart_count": "0", **fields}
    (run_dir / LOCK).write_text(json.dumps(holder) + "\n")


def test_lock_refuses_live_and_foreign_holders_and_takes_over_stale_ones(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    d = tmp_path / "run"
    _write_lock(d)  # this very process: alive
    with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()} on host {socket.gethostname()}"):
        RunDirLock(d).acquire()
    _write_lock(d, host="other-node-17", pid=1234)
    with pytest.raises(RunDirError, match=f"other-node-17.*delete {d / LOCK}"):
        RunDirLock(d).acquire()
    dead = _dead_pid()
    _write_lock(d, pid=dead)
    said = []
    lock = RunDirLock(d).acquire(log=said.append)
    assert said and f"pid {dead}" in said[0] and "that process is gone" in said[0]
    assert json.loads((d / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (d / LOCK).exists() and d.exists()  # the directory existed before: it stays
    # A requeued SLURM job takes over the lock its earlier incarnation left on another node.
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    _write_lock(d, host="other-node-17", pid=1234, slurm_job_id="4242", slurm_restart_count="0")
    said.clear()
    RunDirLock(d).acquire(log=said.append).release()
    assert "earlier incarnation of this SLURM job" in said[0]
    (d / LOCK).write_text("garbage")
    with pytest.raises(RunDirError, match="not a lock hybridpar wrote"):
        RunDirLock(d).acquire()


def test_lock_cleans_up_what_it_created_and_refuses_a_file(tmp_path):
    new = tmp_path / "a" / "b" / "run"
    lock = RunDirLock(new).acquire()
    assert (new / LOCK).is_file()
    lock.release()
    assert not (tmp_path / "a").exists()  # a refused start leaves no trace
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        RunDirLock(f).acquire()


def test_two_runs_on_one_run_dir(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    steps = 60  # long enough (~10 s here) to outlive the second process's start-up (~4 s)
    first = subprocess.Popen([sys.executable, *_args(cache_dir, run_dir, steps)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and first.poll() is None:
        if metrics.exists() and '"step": 2,' in metrics.read_text():
            break
        time.sleep(0.01)
    assert first.poll() is None, "the first run ended before the second could start"
    second = run_cli(_args(cache_dir, run_dir, steps))
    line = _one_line_error(second)
    assert f"run.dir={str(run_dir)!r} is in use by pid {first.pid}" in line
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    steps_logged = [json.loads(r)["step"] for r in metrics.read_text().splitlines()]
    assert steps_logged == list(range(1, steps + 1))  # every row once, in order
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_00000058", "step_00000060"]
    assert not (run_dir / LOCK).exists()


def test_run_dir_that_is_a_file_is_one_line(tmp_path, cache_dir):
    f = tmp_path / "not-a-dir"
    f.write_text("keep me\n")
    line = _one_line_error(run_cli(_args(cache_dir, f, 2)))
    assert "is a file, not a directory" in line and f.read_text() == "keep me\n"



_IN_OWN_MOUNT = """
set -u
mount -t tmpfs -o size=4m tmpfs "$MNT" || exit 90
if [ "$MODE" = readonly ]; then mount -o remount,ro "$MNT" || exit 91; fi
cd "$ROOT"
timeout 300 "$PY" "$@" > "$OUT/stdout" 2> "$OUT/stderr" &
pid=$!
if [ "$MODE" = fill ]; then  # once step 3 is logged, fill the file system the run writes its metrics to
    for i in $(seq 1 3000); do grep -q '"step": 3,' "$MNT/run/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done
    ls "$MNT/run" > "$OUT/before"
    head -c 8M /dev/zero > "$MNT/filler" 2>/dev/null
fi
wait $pid
echo $? > "$OUT/rc"
cp "$MNT/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
ls -a "$MNT/run" > "$OUT/after" 2>/dev/null
exit 0
"""


@pytest.mark.parametrize("mode", ["readonly", "fill"])
def test_read_only_and_full_file_systems_are_one_line(mode, tmp_path, cache_dir):
    """The run dir on a real file system of its own (a 4 MiB tmpfs in a private mount namespace): read-only from the
    start (a traceback from mkdir before), or filled up while the run writes its metrics and time record (a
    traceback from either file). Each gives one line and exit 2; the full one keeps the rows written and leaves no lock."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    argv = _args(cache_dir, mnt / "run", 400, "--train.seq_len", "32", "--logging.interval", "1",
                 "--checkpoint.interval", "0", "--model.n_layers", "1")
    env = {**user_env(), "MNT": str(mnt), "MODE": mode, "ROOT": str(ROOT), "PY": sys.executable, "OUT": str(out)}
    done = subprocess.run(["unshare", "-m", "bash", "-c", _IN_OWN_MOUNT, "script", *argv], env=env, timeout=400,
                          capture_output=True, text=True)
    assert done.returncode == 0 and (out / "rc").read_text().strip() == "2", (done.stderr, (out / "stderr").read_text())
    lines = (out / "stderr").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    if mode == "readonly":
        assert f"run.dir='{mnt / 'run'}' cannot be created (read-only file system)" in lines[0]
    else:
        # the file that met the full disk first: the metrics row or the time record written after it
        assert (f"{mnt / 'run' / 'metrics.jsonl'}: no space left on device while writing the metrics of step"
                in lines[0] or f"writing {mnt / 'run' / 'goodput.json'}: no space left on device" in lines[0]), lines
        assert lines[0].endswith("start the same command again (it resumes from the latest complete checkpoint)")
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()[:-1]]  # the last may be torn
        assert [r["step"] for r in rows if "loss" in r][:3] == [1, 2, 3]
        assert LOCK not in (out / "after").read_text().split()

# -- 3. a resume cannot silently change what the data position means --------------------------------------------
def test_resume_with_other_data_settings_is_refused_then_allowed(trained, tmp_path, cache_dir):
    run_dir = _copy_run(trained, tmp_path)
    before = _tree(run_dir)
    out = run_cli(_args(cache_dir, run_dir, 6, "--train.seed", "7", "--data.split", "90,10,0"))
    line = _one_line_error(out)
    assert "train.seed: checkpoint 1234 vs now 7" in line and "data.split: checkpoint '95,5,0' vs now '90,10,0'" in line
    assert "--checkpoint.allow_data_change true" in line
    assert _tree(run_dir) == before  # config.yaml, metrics.jsonl, checkpoints: byte-identical
    out = run_cli(_args(cache_dir, run_dir, 6, "--train.seed", "7", "--checkpoint.allow_data_change", "true"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 4, "data_change": "train.seed: checkpoint 1234 vs now 7"} in rows
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


# -- 4. index files checked against their data -------------------------------------------------------------------
def _write_index(prefix: Path, docs: list[list[int]]) -> None:
    from hybridpar.data.indexed import IndexedWriter

    with IndexedWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(np.asarray(d))


def _patch(idx: Path, offset: int, values: np.ndarray) -> None:
    raw = bytearray(idx.read_bytes())
    raw[offset:offset + values.nbytes] = values.tobytes()
    idx.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["negative-size", "pointer", "longer-bin", "docs-not-monotone", "docs-end"])
def test_index_that_disagrees_with_its_data_is_refused(damage, tmp_path):
    from hybridpar.data.indexed import IndexedTokens

    prefix = tmp_path / "d"
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    _write_index(prefix, docs)
    idx, n = tmp_path / "d.idx", len(docs)
    sizes_at, ptrs_at, docs_at = 34, 34 + 4 * n, 34 + 12 * n  # header, int32 sizes, int64 pointers, int64 docs
    IndexedTokens(prefix)  # the undamaged pair opens
    if damage == "negative-size":
        _patch(idx, sizes_at + 4 * 2, np.array([-4], np.int32))
        match = "sequence 2 has a negative size"
    elif damage == "pointer":
        _patch(idx, ptrs_at + 8 * 3, np.array([2], np.int64))  # sequence 3 must start at byte 2 * (3+2+4) = 18
        match = "sequence 3 points at byte 2, but the sizes before it put it at 18"
    elif damage == "longer-bin":  # the index of a shorter dataset beside a longer .bin
        _write_index(tmp_path / "short", docs[:2])
        shutil.copy(tmp_path / "short.idx", idx)
        match = "belong to different datasets"
    elif damage == "docs-not-monotone":
        _patch(idx, docs_at + 8 * 2, np.array([0], np.int64))
        match = r"document boundary 2 \(0\) is below the one before it \(1\)"
    else:
        _patch(idx, docs_at + 8 * n, np.array([n + 3], np.int64))
        match = f"run from 0 to {n + 3}, not from 0 to the {n} sequences"
    with pytest.raises(DataError, match=match) as err:
        IndexedTokens(prefix)
    assert "d." in str(err.value)  # names the file


# -- 5. preprocessing input -------------------------------------------------------------------------------------
def test_preprocessing_skips_non_text_refuses_bad_bytes_and_warns(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "launch"))
    import preprocess_data
    import train_tokenizer

    from hybridpar.data.indexed import IndexedTokens
    from hybridpar.data.tokenizer import load_tokenizer

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hello world"}\n{"text": null}\n{"text": 123}\n{"text": "more words"}\n')
    tok = tmp_path / "tok.json"
    assert train_tokenizer.cli(["--input", str(src), "--vocab-size", "600", "--output", str(tok)]) == 0
    err = capsys.readouterr().err
    assert "fewer than --vocab-size 600" in err and "1 record(s) with null 'text', 1 record(s) with int 'text'" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    assert preprocess_data.cli(["--input", str(src), str(empty), "--tokenizer", f"bpe:{tok}",
                                "--output-prefix", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"--input {empty} holds no documents" in err and "null 'text'" in err
    t = load_tokenizer(f"bpe:{tok}")
    data = IndexedTokens(out)
    assert [t.decode(data[i][:-1]) for i in range(len(data))] == ["hello world", "more words"]  # no "None", "123"
    assert preprocess_data.cli(["--input", str(src), "--tokenizer", f"bpe:{tok}", "--output-prefix",
                                str(tmp_path / "strict"), "--strict"]) == 2
    assert f"{src}:2: 'text' is null, not text" in capsys.readouterr().err
    assert not list(tmp_path.glob("strict*"))
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    assert preprocess_data.cli(["--input", str(bad), "--tokenizer", f"bpe:{tok}", "--output-prefix",
                                str(tmp_path / "bad")]) == 2
    assert f"{bad}:2 is not UTF-8 (byte 0xe9 at column 14)" in capsys.readouterr().err
    assert not list(tmp_path.glob("bad.*"))


# -- 6. non-finite streaks ---------------------------------------------------------------------------------------
def test_no_checkpoint_is_saved_inside_a_non_finite_streak(trained, tmp_path, cache_dir):
    run_dir = _copy_run(trained, tmp_path)
    # the weights x 1e30 after step 5's backward (tests/fault_drill.py; the config refuses a learning rate that
    # would do it): step 5 itself is finite, its update leaves weights that overflow steps 6-8
    out = run_cli(["tests/fault_drill.py", "0", "5", "w1e30", *_args(cache_dir, run_dir, 8,
                                                                    "--train.max_skipped_steps", "10")[1:]])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("optimizer step skipped") == 3
    latest = checkpoint_dir(run_dir, 4)
    for step, streak in ((6, 1), (8, 3)):
        assert (f"not saving a checkpoint at step {step}: {streak} non-finite step(s) in a row; the latest "
                f"checkpoint {latest} predates the streak") in out.stdout
    assert latest_checkpoint(run_dir) == latest  # a resume starts before the streak


def test_non_finite_settings_are_refused():
    from hybridpar.config.cli import load_config
    from hybridpar.errors import ConfigError

    for value in ("inf", "nan", "-inf"):
        with pytest.raises(ConfigError, match=f"optim.lr='{value}' must be a finite number"):
            load_config(["--optim.lr", value])


# -- 7. user-caused conditions are one line ----------------------------------------------------------------------
def test_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, cache_dir):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    # A real full file system: a 24 MiB tmpfs holds one checkpoint of the tiny model (~19 MiB) but not two.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=True)
    try:
        run_dir = mnt / "run"
        line = _one_line_error(run_cli(_args(cache_dir, run_dir, 6)))
        assert line.startswith(f"error: no space left on {run_dir / 'checkpoints'} while saving checkpoint "
                               f"step_00000004; the latest complete checkpoint is {checkpoint_dir(run_dir, 2)}")
        assert latest_checkpoint(run_dir) == checkpoint_dir(run_dir, 2)
        assert not checkpoint_dir(run_dir, 4).exists()  # the partial save is gone, its space given back
        load_full_model_state(checkpoint_dir(run_dir, 2))  # and the previous one is whole
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_deleted_shard_of_a_complete_checkpoint_is_one_line(trained, tmp_path, cache_dir):
    run_dir = _copy_run(trained, tmp_path)
    (checkpoint_dir(run_dir, 4) / "__0_0.distcp").unlink()
    line = _one_line_error(run_cli(_args(cache_dir, run_dir, 6)))
    assert f"checkpoint {checkpoint_dir(run_dir, 4)} is missing its shard __0_0.distcp" in line


def test_plot_metrics_skips_torn_lines_and_refuses_empty_files(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "launch"))
    import plot_metrics

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 1, "loss": 5.0, "lr": 1e-3}, {"step": 2, "loss": 4.0, "lr": 1e-3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert plot_metrics.read_rows(run) == rows
    assert "metrics.jsonl:3 is not a metrics row" in capsys.readouterr().err
    damaged = [{"step": "3", "loss": 3.0}, {"step": True, "loss": 3.0}, {"step": 3, "loss": "3.0"},
               {"step": 3, "loss": 3.0, "consumed_tokens": "96"}, {"step": 3, "lr": [1e-3]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + damaged))
    assert plot_metrics.read_rows(run) == rows
    assert capsys.readouterr().err.count("is not a metrics row") == len(damaged)
    assert plot_metrics.cli([str(run), "--out", str(tmp_path / "d.png")]) == 0  # a traceback before
    assert plot_metrics.cli([str(run), "--out", str(tmp_path / "p.png")]) == 0 and (tmp_path / "p.png").is_file()
    (run / "metrics.jsonl").write_text("")
    assert plot_metrics.cli([str(run), "--out", str(tmp_path / "q.png")]) == 2
    assert "holds no metrics rows yet" in capsys.readouterr().err and not (tmp_path / "q.png").exists()
    # --out must name an image: a directory was written as DIR.png with "wrote DIR", another suffix was a traceback
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for out, why in [(tmp_path, "it was a directory"), (tmp_path / "p.bmpx", "no image type matplotlib writes")]:
        assert plot_metrics.cli([str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: name an image file ending in .png" in err and why in err and err.count("\n") == 1
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists() and not (tmp_path / "p.bmpx").exists()


def test_locks_whose_holder_is_certainly_gone_are_taken_over(tmp_path):
    """An empty .lock (its starter died between creating and writing it, e.g. on a full disk), a pid that is not a
    process id, and a zombie holder each blocked every later start; a live holder is still refused."""
    host, lock = socket.gethostname(), tmp_path / LOCK
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
        time.sleep(0.05)  # exited, not reaped yet
    for content, reason in [("", "an empty lock"), (json.dumps({"host": host, "pid": "abc"}), "is not a process id"),
                            (json.dumps({"host": host, "pid": zombie.pid}), "that process is gone")]:
        lock.write_text(content)
        said = []
        RunDirLock(tmp_path).acquire(log=said.append).release()
        assert len(said) == 1 and reason in said[0], said
    zombie.wait()
    lock.write_text(json.dumps({"host": host, "pid": os.getpid()}))
    with pytest.raises(RunDirError, match="is in use by pid"):
        RunDirLock(tmp_path).acquire(log=print)


pytestmark = pytest.mark.multiprocess  # every test here starts processes
