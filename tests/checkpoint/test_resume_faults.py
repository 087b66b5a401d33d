"""Resume gaps (issue 12 item 4): kill the ServerApp, rerun with resume=true.

- every node of the run is queried again and may rejoin, a node lost before the
  crash too;
- a resume whose settings differ from the checkpoint's in what changes the result is
  refused naming each key, unless ``resume-allow-changes`` lists it (then logged);
- the checkpoint carries a checksum: a truncated, empty, garbage or one-byte-changed
  file is refused naming the file and the cause, before any message is sent;
- the checkpoint carries its format: one without it (a development version's) or of
  another format is refused naming the file, the format found and what to do;
- ``resume=true`` without a checkpoint fails.

The quadratic ClientApp (node p returns w - target_p) and the virtual clock make each
run reproducible; "killing" the ServerApp is an exception out of its evaluation.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import zipfile

import numpy as np
import pytest
from flwr.app import MetricRecord

from flwr_gsgm.checkpoint.files import CHECKPOINT_FORMAT, CheckpointError, load, save
from flwr_gsgm.checkpoint.resume import ResumeRefused
from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from tests.engine.quadratic_app import initial_arrays, make_app

CLOCK = VirtualClock(seed=3, base_duration=1.0, slow_fraction=0.25, slow_factor=4.0, jitter=0.1)
RUN_CONFIG = {"server-learning-rate": 0.1, "beta": 0.5, "seed": 3, "client-mode": "gradient"}


class CountingGrid(InProcessGrid):
    """In-process grid counting the messages pushed and the train messages per partition."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushed = 0
        self.trained: list[int] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.pushed += len(messages)
        for msg in messages:
            if msg.metadata.message_type == "train":
                ctx = self.contexts[msg.metadata.dst_node_id]
                self.trained.append(int(ctx.node_config["partition-id"]))
        return super().push_messages(messages)


def dies_at(updates):
    """An evaluate_fn that kills the run (like SIGKILL) at ``updates``."""

    def evaluate(step, arrays):
        if step == updates:
            raise KeyboardInterrupt("killed")
        return MetricRecord({"accuracy": float(arrays["w"].numpy()[0]), "loss": 0.0})

    return evaluate


def start(
    path,
    *,
    cls=GSGM,
    nodes=3,
    app=None,
    resume=False,
    run_config=RUN_CONFIG,
    allow=(),
    lr=0.1,
    evaluate_fn=None,
    max_updates=60,
    grid=None,
    **engine,
):
    settings = EngineSettings(
        checkpoint_path=path,
        checkpoint_every=10,
        resume=resume,
        run_config=run_config,
        resume_allow_changes=tuple(allow),
        **engine,
    )
    grid = grid or CountingGrid(app or make_app(), nodes, run_config={})
    strategy = cls(server_learning_rate=lr, virtual_clock=CLOCK, seed=3, engine=settings)
    result = strategy.start(
        grid,
        initial_arrays(),
        max_updates=max_updates,
        eval_every=10,
        evaluate_fn=evaluate_fn
        or (lambda s, a: MetricRecord({"accuracy": float(a["w"].numpy()[0]), "loss": 0.0})),
    )
    return result, grid


def killed_run(path, **kw):
    """Run until the evaluation at 30 updates kills it (checkpoint at 20 on disk)."""
    with pytest.raises(KeyboardInterrupt):
        start(path, evaluate_fn=dies_at(30), **kw)
    assert path.exists()


# ------------------------------------------------------------ checkpoint files
def test_resume_without_a_checkpoint_fails_before_any_message(tmp_path):
    path = tmp_path / "run" / "checkpoint.pt"
    grid = CountingGrid(make_app(), 3, run_config={})
    strategy = GSGM(
        virtual_clock=CLOCK,
        engine=EngineSettings(checkpoint_path=path, checkpoint_every=10, resume=True),
    )
    with pytest.raises(CheckpointError) as info:
        strategy.start(grid, initial_arrays(), max_updates=20)
    assert str(info.value) == (
        f"resume=true, but there is no checkpoint at {path}: check run-name and output-dir "
        "(the run folder of the run to continue), and that the run had checkpoint-every > 0; "
        "to start afresh, set resume=false"
    )
    assert grid.pushed == 0


def damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(b"\x00garbage\xff" * 100)
    elif how == "one byte":
        # A byte in the middle of the data (a weight, say): the checksum line is intact.
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1 :])
    return len(data)


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "one byte"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_cause(tmp_path, how):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    size = damage(path, how)
    with pytest.raises(CheckpointError) as info:
        start(path, resume=True)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path} ")
    if how == "truncated":
        assert message == (
            f"checkpoint {path} ({size // 2} bytes) has no checksum line at its end: it is "
            "truncated, or is not a flwr-gsgm checkpoint of format 2 "
            # a zip's local header: version 2.0, data descriptor, stored, 1980-01-01
            "(it starts with b'PK\\x03\\x04\\x14\\x00\\x08\\x00\\x00\\x00\\x00\\x00"
            "!\\x00\\x00\\x00')"
        )
    elif how == "empty":
        assert message == f"checkpoint {path} is empty (0 bytes)"
    elif how == "garbage":
        assert "has no checksum line at its end" in message
        assert message.endswith("(it starts with b'\\x00garbage\\xff\\x00garbag')")
    else:
        assert re.fullmatch(
            rf"checkpoint {re.escape(str(path))} is damaged: the SHA-256 of its \d+ bytes of "
            r"data is [0-9a-f]{64}, its checksum line records [0-9a-f]{64}",
            message,
        )


def test_a_checkpoint_loads_back_every_value_with_its_type(tmp_path):
    """The archive: state.json plus one .npy per array, read without pickle."""
    path = tmp_path / "checkpoint.pt"
    state = {
        "w": np.array([[0.5, -1.25], [3.0, 1e-45]], dtype=np.float32),  # 1e-45: subnormal
        "version": np.int64(7),
        "rate": np.float64(0.1),
        "nodes": {0: {"since": 2.5}, 2: None},  # partition-ids: int keys
        "pair": (1, ("a", 2)),
        "seen": {3, 4},
        "losses": [0.1 + 0.2, float("nan"), float("inf"), -0.0],
        "__tuple__": "a key that looks like a tag",
        "checkpoint_format": "a key named as the format's",
        "flag": True,
    }
    save(path, state)
    got = load(path)
    assert got.keys() == state.keys()
    assert got["w"].dtype == np.float32 and got["w"].tobytes() == state["w"].tobytes()
    assert type(got["version"]) is np.int64 and got["version"] == 7
    assert type(got["rate"]) is np.float64 and got["rate"] == 0.1
    assert got["nodes"] == {0: {"since": 2.5}, 2: None}
    assert got["pair"] == (1, ("a", 2)) and got["seen"] == {3, 4}
    assert got["losses"][0] == 0.30000000000000004 and np.isnan(got["losses"][1])
    assert got["losses"][2:] == [float("inf"), 0.0] and str(got["losses"][3]) == "-0.0"
    assert (got["__tuple__"], got["flag"]) == ("a key that looks like a tag", True)
    assert got["checkpoint_format"] == "a key named as the format's"
    archive = np.load(path, allow_pickle=False)  # an .npz: numpy reads it too
    assert archive.files == ["state.json", "0", "1", "2"]
    assert archive["1"].shape == () and archive["1"] == 7
    first = data_size(path)
    save(path, state)  # the same state gives the same bytes (members dated 1980)
    assert data_size(path) == first


def data_size(path):
    """The checksum line: (SHA-256, bytes) of the archive."""
    return path.read_bytes().rsplit(b"\n", 2)[1]


def rewrite_format(path, fmt):
    """Rewrite the checkpoint at ``path`` with ``checkpoint_format`` set to ``fmt`` (or
    without it, or without state.json, for ``"no key"``, ``"no state.json"``), its
    checksum line written anew: a checkpoint of another format, intact."""
    raw = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(raw[: raw.rindex(b"\nflwr-gsgm-checkpoint")])) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    tree = json.loads(members["state.json"])
    assert tree["checkpoint_format"] == CHECKPOINT_FORMAT == 2  # written by every save
    if fmt == "no state.json":  # as a torch.save checkpoint: data.pkl and tensors
        members = {"archive/data.pkl": b"\x80\x02}q\x00.", "archive/version": b"3\n"}
    elif fmt == "no key":
        del tree["checkpoint_format"]
    else:
        tree["checkpoint_format"] = fmt
    if "state.json" in members:
        members["state.json"] = json.dumps(tree).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    path.write_bytes(data + f"\nflwr-gsgm-checkpoint sha256={digest} bytes={len(data)}\n".encode())


@pytest.mark.parametrize(
    "fmt, found",
    [
        ("no key", "none: written by a development version before 0.1.0's format"),
        ("no state.json", "none: written by a development version before 0.1.0's format"),
        (0, "0"),
        (1, "1"),
        (3, "3"),
        ("2", "'2'"),
    ],
)
def test_a_checkpoint_of_another_format_is_refused_before_any_message(tmp_path, fmt, found):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    rewrite_format(path, fmt)
    grid = CountingGrid(make_app(), 3, run_config={})
    with pytest.raises(CheckpointError) as info:
        start(path, resume=True, grid=grid)
    assert str(info.value) == (
        f"checkpoint {path} has checkpoint format {found}; this flwr-gsgm reads format 2 "
        "only. Start a new run (resume=false, or another run-name), or resume this one "
        "with the flwr-gsgm version that wrote it"
    )
    assert grid.pushed == 0  # refused before any message


def test_a_checkpoint_of_this_format_resumes_after_a_rewrite(tmp_path):
    # The rewrite itself keeps a checkpoint usable: only the format refuses above.
    whole, _ = start(tmp_path / "whole.pt")
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    rewrite_format(path, CHECKPOINT_FORMAT)
    resumed, _ = start(path, resume=True)
    assert resumed.report.counters == whole.report.counters
    np.testing.assert_array_equal(resumed.arrays["w"].numpy(), whole.arrays["w"].numpy())


def test_a_damaged_checkpoint_stops_the_resume_before_any_message(tmp_path):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    damage(path, "one byte")
    grid = CountingGrid(make_app(), 3, run_config={})
    strategy = GSGM(
        virtual_clock=CLOCK,
        engine=EngineSettings(checkpoint_path=path, checkpoint_every=10, resume=True),
    )
    with pytest.raises(CheckpointError):
        strategy.start(grid, initial_arrays(), max_updates=60)
    assert grid.pushed == 0  # not even the start-up query


def test_an_intact_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    whole, _ = start(tmp_path / "whole.pt")
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    resumed, _ = start(path, resume=True)
    assert resumed.report.counters == whole.report.counters
    for k, v in whole.arrays.items():
        np.testing.assert_array_equal(resumed.arrays[k].numpy(), v.numpy())


# ------------------------------------------------------------------- settings
def test_a_changed_setting_is_refused_naming_each_key(tmp_path):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    changed = {**RUN_CONFIG, "server-learning-rate": 0.05, "beta": 0.9}
    grid_pushed = []
    with pytest.raises(ResumeRefused) as info:
        try:
            start(path, resume=True, run_config=changed, lr=0.05)
        finally:
            grid_pushed.append(True)
    assert str(info.value) == (
        f"resume refused: the run differs from checkpoint {path} in what changes its result: "
        "beta: 0.5 in the checkpoint, 0.9 now; server-learning-rate: 0.1 in the checkpoint, "
        "0.05 now. Resume with the checkpoint's values, or allow the change with "
        'resume-allow-changes="beta,server-learning-rate"'
    )


def test_a_budget_or_timeout_may_change_on_resume(tmp_path):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    # ... and the time-outs and failure bound of the fault handling (issue 12 items 1, 6)
    longer = {
        **RUN_CONFIG,
        "max-updates": 80,
        "message-ttl": 900.0,
        "startup-timeout": 60.0,
        "dispatch-timeout": 100.0,
        "rejoin-timeout": 10.0,
        "max-node-failures": 3,
    }
    result, _ = start(path, resume=True, run_config=longer, max_updates=80)
    assert result.report.counters["updates_received"] == 80


def test_an_allowed_change_is_logged_and_applies(tmp_path, caplog):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    changed = {**RUN_CONFIG, "server-learning-rate": 0.05}
    caplog.set_level(logging.WARNING, logger="flwr")
    result, _ = start(
        path, resume=True, run_config=changed, lr=0.05, allow=["server-learning-rate"]
    )
    assert "resume: server-learning-rate changed from 0.1 to 0.05 (allowed)" in caplog.text
    assert result.report.counters["updates_received"] == 60
    # The new rate applies after the resume: the result differs from both whole runs.
    fast, _ = start(tmp_path / "a.pt")
    slow, _ = start(tmp_path / "b.pt", run_config=changed, lr=0.05)
    w = result.arrays["w"].numpy()
    assert not np.array_equal(w, fast.arrays["w"].numpy())
    assert not np.array_equal(w, slow.arrays["w"].numpy())


def test_a_changed_rule_parameter_without_run_config_is_refused(tmp_path):
    # A strategy started from Python: the rule's parameters and train config compare.
    path = tmp_path / "checkpoint.pt"
    killed_run(path, run_config=None)
    with pytest.raises(ResumeRefused) as info:
        start(path, resume=True, run_config=None, lr=0.05)
    assert "optimizer.lr: 0.1 in the checkpoint, 0.05 now" in str(info.value)


def test_another_number_of_nodes_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    with pytest.raises(ResumeRefused) as info:
        start(path, resume=True, nodes=4)
    assert str(info.value) == (
        f"resume refused: the run differs from checkpoint {path} in what changes its result: "
        "num-partitions: 3 in the checkpoint, 4 now. Resume with the checkpoint's values, or "
        'allow the change with resume-allow-changes="num-partitions"'
    )


# ---------------------------------------------------------------------- nodes
def leaves_at(grid, updates, node_id):
    """An evaluate_fn whose node ``node_id`` leaves the federation at ``updates``; the
    run is killed at 30 updates (checkpoint at 20)."""
    kill = dies_at(30)

    def evaluate(step, arrays):
        if step == updates:
            grid.remove_node(node_id)
        return kill(step, arrays)

    return evaluate


def test_a_node_lost_before_the_crash_rejoins_after_the_resume(tmp_path):
    # Partition 0 (node id 1, a fast node) leaves the federation at 10 updates: its
    # dispatch times out and, its node id gone, it is lost (it may return). The
    # ServerApp is then killed at 30 updates (checkpoint at 20: node 0 lost).
    path = tmp_path / "checkpoint.pt"
    grid = CountingGrid(make_app(), 3, run_config={})
    with pytest.raises(KeyboardInterrupt):
        start(path, cls=ASGD, grid=grid, evaluate_fn=leaves_at(grid, 10, 1), dispatch_timeout=0.3)
    saved = load(path)
    assert saved["nodes"][0]["active"] is False and saved["nodes"][0]["may_return"] is True
    assert saved["counters"]["nodes_lost"] == 1
    # Resumed with partition 0's SuperNode back: it answers the start-up query and trains.
    resumed, grid = start(path, resume=True, cls=ASGD, max_updates=90)
    counters = resumed.report.counters
    assert counters["nodes_joined"] == 1
    assert counters["updates_received"] == 90
    assert resumed.report.per_node["node 1 (partition 0)"]["state"] == "active"
    # Of the 70 updates after the resume, node 0 (as fast as node 1; node 2 is 4x
    # slower) computes about 4 / 9: 31; before the fix it got none.
    assert grid.trained.count(0) >= 25


def test_a_node_excluded_before_the_crash_stays_excluded_after_the_resume(tmp_path):
    # Partition 0 raises in its ClientApp: with max-node-failures=2 its 2nd error reply
    # in a row excludes it for the rest of the run, before the checkpoint at 20.
    path = tmp_path / "checkpoint.pt"
    killed_run(path, app=make_app(raise_for={0}), cls=ASGD, max_node_failures=2)
    saved = load(path)
    assert saved["nodes"][0]["excluded"].startswith("2 failures in a row (max-node-failures=2)")
    # Resumed with partition 0 healthy: the resume is the same run, it stays out.
    resumed, grid = start(path, resume=True, cls=ASGD, max_updates=90, max_node_failures=2)
    assert resumed.report.counters["updates_received"] == 90
    assert resumed.report.counters["nodes_excluded"] == 1
    assert resumed.report.per_node["node 1 (partition 0)"]["state"] == "excluded"
    assert 0 not in grid.trained


def test_the_checkpoint_holds_the_node_counts_norm_bound_and_fingerprint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    killed_run(path, app=make_app(raise_for={0}), cls=ASGD, max_node_failures=2)
    saved = load(path)  # verified against its SHA-256 line: these parts are covered
    # 20 updates: 16 from partition 1, 4 from the 4x slower partition 2; partition 0
    # answered with 2 errors (one back-off, then excluded).
    assert saved["node_stats"]["counts"] == {
        0: {"error_replies": 2, "backoffs": 1},
        1: {"updates_received": 16, "updates_applied": 16},
        2: {"updates_received": 4, "updates_applied": 4},
    }
    assert saved["norm_bound"]["seen"] == len(saved["norm_bound"]["norms"]) == 20
    assert saved["fingerprint"] == {
        "beta": 0.5,
        "client-mode": "gradient",
        "seed": 3,
        "server-learning-rate": 0.1,
    }


def test_a_node_silent_at_the_resume_is_lost_and_the_others_go_on(tmp_path):
    path = tmp_path / "checkpoint.pt"
    killed_run(path)
    # Partition 1's SuperNode does not come back: 2 nodes answer out of 3.
    settings = EngineSettings(
        checkpoint_path=path, checkpoint_every=10, resume=True, run_config=RUN_CONFIG
    )
    grid = CountingGrid(make_app(), 3, run_config={})
    grid.remove_node(2)  # node id 2 holds partition 1
    strategy = GSGM(server_learning_rate=0.1, virtual_clock=CLOCK, seed=3, engine=settings)
    result = strategy.start(grid, initial_arrays(), max_updates=60, eval_every=10)
    assert result.report.counters["updates_received"] == 60
    assert 1 not in grid.trained
    assert result.report.counters["nodes_lost"] >= 1
