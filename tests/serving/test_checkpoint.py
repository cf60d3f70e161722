"""qbits.serving.save / restore on damaged, foreign and unwritable paths."""

import asyncio
import contextlib
import glob
import hashlib
import json
import logging
import os
import pathlib
import shutil
import signal
import threading

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import qbits
import qbits.serving as serving

# The module fixtures run once: these tests share one worker.
pytestmark = pytest.mark.xdist_group("checkpoint")

# head stays float: a checkpoint mixes stored and float arrays.
CONFIG = qbits.QuantConfig(rules=(qbits.Rule("head", None),), default="int8_fwd")


class Net(nn.Module):
    head: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256, name="fc1")(x))
        return nn.Dense(self.head, name="head")(x)


def _uniform(key, shape):
    # Full-entropy int8 values: Orbax's zstd stores them as they are, so a
    # flipped byte changes a weight instead of failing to decompress.
    return jax.random.uniform(key, shape, minval=-1.0, maxval=1.0)


@pytest.fixture(scope="module")
def linen_setup():
    x = jax.random.normal(jax.random.key(0), (4, 512))
    params = Net().init(jax.random.key(1), x)
    params["params"]["fc1"]["kernel"] = _uniform(jax.random.key(2), (512, 256))
    return Net(), params, x


def _linen(linen_setup, seed=0):
    model, params, x = linen_setup
    if seed:  # other weights, same config and shapes
        params = jax.tree.map(lambda a: a + 0.01 * seed, params)
    return serving.convert(model, CONFIG, params, x)


def _nnx(seed=0):
    net = nnx.Sequential(
        nnx.Linear(512, 256, rngs=nnx.Rngs(seed)),
        nnx.relu,
        nnx.Linear(256, 10, rngs=nnx.Rngs(seed + 1)),
    )
    net.layers[0].kernel.set_value(_uniform(jax.random.key(seed), (512, 256)))
    return serving.convert(net, "int8_fwd", jnp.ones((2, 512)))


def _arrays(serving_thing):
    if isinstance(serving_thing, serving.ServingParams):
        return jax.tree.leaves(serving_thing)
    return jax.tree.leaves(nnx.state(serving_thing))


def _assert_same(a, b):
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _largest(path):
    files = glob.glob(os.path.join(path, "**", "*"), recursive=True)
    return max((f for f in files if os.path.isfile(f)), key=os.path.getsize)


def _flip(path, at=0.5, count=4):
    """Flips ``count`` bytes at fraction ``at`` of the checkpoint's largest file."""
    name = pathlib.Path(_largest(path))
    data = bytearray(name.read_bytes())
    start = int(len(data) * at)
    for i in range(start, start + count):
        data[i] ^= 0xFF
    name.write_bytes(bytes(data))


def _truncate(path):
    name = pathlib.Path(_largest(path))
    name.write_bytes(name.read_bytes()[: len(name.read_bytes()) // 2])


def _meta_file(path):
    return pathlib.Path(path) / "meta" / "metadata"


def _read_meta(path):
    return json.loads(_meta_file(path).read_text())


def _edit_meta(path, edit):
    meta = _read_meta(path)
    edit(meta)
    _meta_file(path).write_text(json.dumps(meta))


def test_checkpoint_records_each_arrays_checksum(tmp_path, linen_setup):
    sp = _linen(linen_setup)
    serving.save(tmp_path / "ckpt", sp)
    meta = _read_meta(tmp_path / "ckpt")
    assert meta["version"] == 3
    qvalue = np.asarray(sp.weights["fc1"]["qvalue"])
    assert meta["checksums"]["weights/fc1/qvalue"] == {
        "shape": [512, 256],
        "dtype": "int8",
        "sha256": hashlib.sha256(qvalue.tobytes()).hexdigest(),
    }
    paths = [a for a in jax.tree.leaves(sp) if a.size]  # not the placeholders
    assert len(meta["checksums"]) == len(paths)
    _assert_same(serving.restore(tmp_path / "ckpt", sp), sp)


def test_flipped_bytes_are_refused_naming_the_array(tmp_path, linen_setup):
    # The adversarial report: 4 flipped bytes served other weights.
    sp = _linen(linen_setup)
    path = tmp_path / "ckpt"
    serving.save(path, sp)
    _flip(path)
    with pytest.raises(qbits.InvalidArgumentError) as info:
        serving.restore(path, sp)
    message = str(info.value)
    assert str(path) in message
    assert "array 'weights/fc1/qvalue' does not match the SHA-256" in message
    assert "\n" not in message


def test_flipped_bytes_leave_an_nnx_target_unchanged(tmp_path):
    served = _nnx()
    path = tmp_path / "ckpt"
    serving.save(path, served)
    _flip(path)
    target = _nnx(seed=5)
    before = [np.asarray(a).copy() for a in _arrays(target)]
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"array 'qbits/stored/layers/0/.*SHA-256"
    ):
        serving.restore(path, target)
    for a, b in zip(before, _arrays(target), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def _no_checksum(array):
    def edit(meta):
        meta["checksums"][array]["sha256"] = None

    return edit


def _version_1(meta):
    meta["version"] = 1


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_version_1, r"format version 1, written before qbits stored checksums"),
        (
            _no_checksum("weights/fc1/qvalue"),
            r"array 'weights/fc1/qvalue' has no valid SHA-256 checksum",
        ),
        (
            lambda meta: meta["checksums"]["params/params/head/bias"].update(
                sha256="0"
            ),
            r"array 'params/params/head/bias' has no valid SHA-256 checksum"
            r".*sha256='0'",
        ),
    ],
    ids=["version 1", "one checksum null", "one checksum not a digest"],
)
def test_edited_metadata_cannot_skip_the_checksums(tmp_path, linen_setup, edit, why):
    # Changed weights whose metadata says there is nothing to check.
    sp = _linen(linen_setup)
    path = tmp_path / "ckpt"
    serving.save(path, sp)
    _flip(path)
    _edit_meta(path, edit)
    with pytest.raises(qbits.InvalidArgumentError, match=why) as info:
        serving.restore(path, sp)
    assert str(info.value).startswith(f"qbits.serving.restore: directory='{path}'")


def _delete(name):
    return lambda path: shutil.rmtree(os.path.join(path, name))


def _remove(name):
    return lambda path: os.remove(os.path.join(path, name))


def _garble(path):
    _meta_file(path).write_text('{"format": "qbits.serving", "vers')


def _set(key, value):
    return lambda path: _edit_meta(path, lambda meta: meta.__setitem__(key, value))


# What is done to a fresh checkpoint, what the error says, whether an error of
# Orbax's (or json's) is chained.
BROKEN = {
    "truncated array file": (_truncate, r"its arrays cannot be read", True),
    "deleted meta": (_delete("meta"), r"no 'meta' item \(meta/ is missing\)", False),
    "deleted arrays": (_delete("arrays"), r"no 'arrays' item", False),
    "garbled meta": (_garble, r"meta item is not valid JSON \(JSONDecodeError", True),
    "empty meta": (lambda p: _edit_meta(p, dict.clear), r"no format", False),
    "no checksums": (_set("checksums", None), r"no valid 'checksums'", False),
    "bad checksums": (_set("checksums", {"a": 1}), r"no valid 'checksums'", False),
    "newer version": (_set("version", 99), r"version 99; this qbits reads", False),
    "version 0": (
        _set("version", 0),
        r"version 0; this qbits reads version 3\)",
        False,
    ),
    "bad version": (_set("version", "2"), r"version='2'", False),
    "bad kind": (_set("kind", "jax"), r"kind='jax'", False),
    "bad layers": (_set("layers", [{"path": "x"}]), r"bad layers \(", True),
    "deleted array metadata": (_remove("arrays/_METADATA"), r"arrays cannot", True),
    "deleted manifest": (_remove("arrays/manifest.ocdbt"), r"arrays cannot", True),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_checkpoint_raises_one_clear_error(tmp_path, linen_setup, case):
    damage, why, chained = BROKEN[case]
    sp = _linen(linen_setup)
    path = tmp_path / "ckpt"
    serving.save(path, sp)
    damage(str(path))
    with pytest.raises(qbits.InvalidArgumentError, match=why) as info:
        serving.restore(path, sp)
    message = str(info.value)
    assert message.startswith(f"qbits.serving.restore: directory='{path}'")
    assert "\n" not in message and len(message) < 700
    assert (info.value.__cause__ is not None) == chained


def test_paths_that_hold_no_checkpoint_are_refused(tmp_path, linen_setup):
    sp = _linen(linen_setup)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a checkpoint")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    for name, why in [
        ("missing", "it does not exist"),
        ("file", "it is a file, not a directory"),
        ("empty", "it is an empty directory"),
        ("other", "it has no 'meta' item"),
    ]:
        with pytest.raises(qbits.InvalidArgumentError, match=why) as info:
            serving.restore(tmp_path / name, sp)
        assert str(tmp_path / name) in str(info.value)


def test_a_long_path_is_named_in_full(tmp_path, linen_setup):
    path = tmp_path / ("a_very_long_directory_name_" * 4) / "ckpt"
    with pytest.raises(qbits.InvalidArgumentError) as info:
        serving.restore(path, _linen(linen_setup))
    assert f"at {path}: it does not exist" in str(info.value)


def test_target_of_another_model_is_refused_before_reading(tmp_path, linen_setup):
    x = linen_setup[2]
    path = tmp_path / "ckpt"
    serving.save(path, _linen(linen_setup))
    # Same config and stored layers; the float head has another size.
    wide = Net(head=12)
    other = serving.convert(wide, CONFIG, wide.init(jax.random.key(1), x), x)
    with pytest.raises(
        qbits.InvalidArgumentError,
        match=r"array 'params/params/head/bias': shape \(12,\)"
        r".*shape \(10,\) \(float32\)",
    ):
        serving.restore(path, other)
    # A target without an array the checkpoint holds.
    fewer = jax.tree.map(lambda a: a, other.params)
    del fewer["params"]["head"]
    with pytest.raises(
        qbits.InvalidArgumentError, match=r"'params/params/head/bias': missing"
    ):
        serving.restore(path, other.replace(params=fewer))


def test_save_onto_an_existing_path_needs_force(tmp_path, linen_setup):
    path = tmp_path / "ckpt"
    old, new = _linen(linen_setup), _linen(linen_setup, seed=3)
    serving.save(path, old)
    with pytest.raises(qbits.InvalidArgumentError, match=r"exists already.*force=True"):
        serving.save(path, new)
    _assert_same(serving.restore(path, old), old)
    serving.save(path, new, force=True)
    _assert_same(serving.restore(path, old), new)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing left beside it
    with pytest.raises(qbits.InvalidArgumentError, match="force"):
        serving.save(path, new, force="yes")
    # force replaces a checkpoint (or an empty directory), nothing else.
    (tmp_path / "empty").mkdir()
    serving.save(tmp_path / "empty", new, force=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(qbits.InvalidArgumentError, match="not a directory"):
        serving.save(tmp_path / "file", new, force=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    with pytest.raises(qbits.InvalidArgumentError, match=r"holds 'keep\.txt'"):
        serving.save(tmp_path / "data", new, force=True)
    assert (tmp_path / "data" / "keep.txt").read_text() == "precious"


def _checkpoint_plus(name, data="mine"):
    """A checkpoint qbits wrote, with a file of the user's added at ``name``."""

    def make(path, sp):
        serving.save(path, sp)
        (path / name).write_text(data)
        return path / name

    return make


def _folder(*names, meta=None):
    """A user's folder holding ``names`` (``x/`` a folder) and a notes file."""

    def make(path, sp):
        del sp
        path.mkdir()
        for name in names:
            if name.endswith("/"):
                (path / name).mkdir()
            else:
                (path / name).write_text("")
        if meta is not None:
            (path / "meta" / "metadata").write_text(json.dumps(meta))
        (path / "results.csv").write_text("mine")
        return path / "results.csv"

    return make


def _linked_arrays(path, sp):
    (path.parent / "data").mkdir()
    (path.parent / "data" / "weights.npy").write_text("mine")
    serving.save(path, sp)
    shutil.rmtree(path / "arrays")
    (path / "arrays").symlink_to(path.parent / "data")
    return path.parent / "data" / "weights.npy"


def _only_qbits_json(path, sp):
    # Only what a checkpoint holds, but the metadata is not qbits'.
    serving.save(path, sp)
    (path / "meta" / "metadata").write_text('{"format": "my.tool", "notes": 1}')
    return path / "meta" / "metadata"


# A folder force=True must not replace: (how to make it, text of the error).
NOT_OURS = {
    "arrays/ and a file": (_folder("arrays/"), "holds 'results.csv'"),
    "Orbax's marker and a file": (
        _folder("_CHECKPOINT_METADATA"),
        "holds 'results.csv'",
    ),
    "a file added to a checkpoint": (_checkpoint_plus("draft.md"), "'draft.md'"),
    "a file added in meta/": (_checkpoint_plus("meta/notes"), "'meta/notes'"),
    "a file added in arrays/": (_checkpoint_plus("arrays/x.npy"), "'arrays/x.npy'"),
    "arrays/ a link": (_linked_arrays, "'arrays' is not a directory as qbits"),
    "another tool's metadata": (_only_qbits_json, "no format 'qbits.serving'"),
}


@pytest.mark.parametrize("case", NOT_OURS)
def test_force_replaces_only_a_checkpoint_qbits_wrote(tmp_path, linen_setup, case):
    make, why = NOT_OURS[case]
    path = tmp_path / "ckpt"
    precious = make(path, _linen(linen_setup))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    content = precious.read_text()
    with pytest.raises(qbits.InvalidArgumentError) as info:
        serving.save(path, _linen(linen_setup, seed=3), force=True)
    message = str(info.value)
    assert "force=True replaces only a checkpoint qbits wrote" in message
    assert why in message
    assert precious.read_text() == content
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing touched


def test_force_never_removes_a_users_folder_in_its_way(tmp_path, linen_setup):
    # save(force=True) writes <path>.qbits-new and moves the old checkpoint to
    # <path>.qbits-old, removing what an interrupted save left there.
    path = tmp_path / "ckpt"
    serving.save(path, _linen(linen_setup))
    for leftover in (".qbits-old", ".qbits-new"):
        folder = tmp_path / f"ckpt{leftover}"
        folder.mkdir()
        (folder / "plan.txt").write_text("mine")
        with pytest.raises(
            qbits.InvalidArgumentError, match=rf"remove {folder}, which is not a"
        ):
            serving.save(path, _linen(linen_setup, seed=3), force=True)
        assert (folder / "plan.txt").read_text() == "mine"
        shutil.rmtree(folder)
    # What an interrupted save leaves there is replaced.
    serving.save(tmp_path / "ckpt.qbits-old", _linen(linen_setup))
    serving.save(path, _linen(linen_setup, seed=3), force=True)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_same(serving.restore(path, _linen(linen_setup)), _linen(linen_setup, 3))


def test_save_to_an_unwritable_place_is_refused(tmp_path, linen_setup):
    sp = _linen(linen_setup)
    (tmp_path / "file").write_text("")
    with pytest.raises(qbits.InvalidArgumentError, match=r"file is a file") as info:
        serving.save(tmp_path / "file" / "sub" / "ckpt", sp)
    assert str(tmp_path / "file" / "sub" / "ckpt") in str(info.value)
    serving.save(tmp_path / "new" / "sub" / "ckpt", sp)  # parents are made


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_save_without_permission_is_refused(tmp_path, linen_setup):
    sp = _linen(linen_setup)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(qbits.InvalidArgumentError, match="no permission to write"):
        serving.save(locked / "ckpt", sp)


def test_failed_save_leaves_no_checkpoint_and_keeps_the_old_one(
    tmp_path, linen_setup, monkeypatch
):
    # The arrays and metadata are written, then the commit fails (disk full).
    def full(self, directory):
        raise OSError(28, "No space left on device")

    old, new = _linen(linen_setup), _linen(linen_setup, seed=3)
    path = tmp_path / "ckpt"
    serving.save(tmp_path / "kept", old)
    with monkeypatch.context() as patch:
        patch.setattr(ocp.CompositeCheckpointHandler, "finalize", full)
        with pytest.raises(
            qbits.InvalidArgumentError, match=r"writing the checkpoint failed.*space"
        ) as info:
            serving.save(path, new)
        assert isinstance(info.value.__cause__, OSError)
        with pytest.raises(qbits.InvalidArgumentError, match="writing the checkpoint"):
            serving.save(tmp_path / "kept", new, force=True)
    # Nothing is left: neither a checkpoint nor Orbax's temporary directory.
    assert sorted(os.listdir(tmp_path)) == ["kept"]
    with pytest.raises(qbits.InvalidArgumentError, match="does not exist"):
        serving.restore(path, old)
    _assert_same(serving.restore(tmp_path / "kept", old), old)  # not replaced
    # Saving again works, over the leftovers.
    serving.save(path, new)
    serving.save(tmp_path / "kept", new, force=True)
    for name in ("ckpt", "kept"):
        _assert_same(serving.restore(tmp_path / name, old), new)


def test_an_unfinished_save_is_refused_by_name(tmp_path, linen_setup):
    # What a save killed mid-way leaves: Orbax's temporary directory.
    sp = _linen(linen_setup)
    serving.save(tmp_path / "ckpt", sp)
    unfinished = tmp_path / "ckpt.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / "ckpt", unfinished)
    with pytest.raises(
        qbits.InvalidArgumentError, match="temporary directory of an unfinished"
    ):
        serving.restore(unfinished, sp)


@contextlib.contextmanager
def _small_files():
    """Writes fail past 64 KiB (EFBIG), as on a full disk; the signal is ignored."""
    resource = pytest.importorskip("resource")
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals can be set from the main thread only")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_save_that_cannot_write_is_one_quiet_error(tmp_path, linen_setup, caplog):
    # Orbax logged ERROR:absl with a traceback for each failed write, and left
    # <path>.orbax-checkpoint-tmp behind.
    sp = _linen(linen_setup)  # fc1's 512 x 256 int8 weights: 128 KiB
    path = tmp_path / "ckpt"
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(
            qbits.InvalidArgumentError, match=r"writing the checkpoint failed"
        ),
        _small_files(),
    ):
        serving.save(path, sp)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert os.listdir(tmp_path) == []


def test_a_failed_read_leaves_nothing_pending(tmp_path, linen_setup, monkeypatch):
    """When one read fails, Orbax's event loop finishes the others first.

    As Orbax runs its reads: at once, in a new event loop closed when the
    first fails; the other read completes later from TensorStore's thread,
    which reported "Event loop is closed" once the loop had been closed.
    """
    sp = _linen(linen_setup)
    path = tmp_path / "ckpt"
    serving.save(path, sp)
    real = ocp.Checkpointer.restore
    other, problems, threads = [], [], []

    async def reads():
        loop = asyncio.get_running_loop()
        done, failed = loop.create_future(), threading.Event()

        def tensorstore():  # completes the other read once the first failed
            failed.wait()
            try:
                loop.call_soon_threadsafe(done.set_result, "read")
            except RuntimeError as e:
                problems.append(e)

        async def read_other():
            return await done

        async def read_damaged():
            failed.set()
            raise OSError("damaged")

        threads.append(threading.Thread(target=tensorstore))
        threads[-1].start()
        other.append(loop.create_task(read_other()))
        await asyncio.gather(other[-1], read_damaged())

    def restore(self, directory, args=None):
        if "arrays" not in args:
            return real(self, directory, args=args)
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(reads())
        finally:
            loop.close()

    monkeypatch.setattr(ocp.Checkpointer, "restore", restore)
    with pytest.raises(qbits.InvalidArgumentError, match="arrays cannot be read"):
        serving.restore(path, sp)
    threads[0].join()
    assert problems == []
    assert other[0].done() and other[0].result() == "read"
