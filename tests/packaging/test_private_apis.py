"""Pins the private attributes of Flower and flwr-datasets the project still uses.

No public API does these jobs in the installed versions. If a test here fails after
an upgrade, the named attribute moved: adapt the module named in the message (or
switch it to a public API if the new release has one), then update the pinned
version below.
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

FLWR_PINNED = "1.42"
#: Minor versions whose private attributes below were checked: 1.42 in CI, 1.43 on
#: flwr-nightly 1.43.0.dev20261026 (scripts/check_flower_nightly.sh, every test then
#: in tests/engine, now in the library's test folders, and tests/simulation_engine
#: passed there).
FLWR_CHECKED = ("1.42", "1.43")
FLWR_DATASETS_PINNED = "0.6"


def _installed(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        if dist == "flwr":  # Flower's pre-releases install as flwr-nightly
            return version("flwr-nightly")
        raise


def _why(attr: str, dist: str, pinned: str, user: str) -> str:
    return (
        f"{user} relies on the private attribute {attr} of {dist} {pinned}.x; "
        f"{dist} {_installed(dist)} is installed and it no longer behaves as expected"
    )


def test_flwr_version_is_the_pinned_one():
    assert _installed("flwr").startswith(tuple(v + "." for v in FLWR_CHECKED)), (
        f"flwr {_installed('flwr')} installed; tests/packaging/test_private_apis.py was checked "
        f"on {', '.join(v + '.x' for v in FLWR_CHECKED)}: re-check the private attributes "
        "below, then add the version"
    )


def test_flwr_message_id_is_stored_in_metadata_dict():
    """InProcessGrid gives messages ids the way a SuperLink does (no public setter)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from flwr_gsgm.simulation.inprocess_grid import _claim_task_identity

    _claim_task_identity(1)
    msg = Message(RecordDict({"config": ConfigRecord()}), 1, "query")
    why = _why(
        "Metadata.__dict__['_message_id']",
        "flwr",
        FLWR_PINNED,
        "flwr_gsgm/simulation/inprocess_grid.py",
    )
    assert "_message_id" in msg.metadata.__dict__, why
    msg.metadata.__dict__["_message_id"] = "pinned-1"
    assert msg.metadata.message_id == "pinned-1", why


def test_flwr_task_identity_has_the_private_fields():
    """InProcessGrid stamps the process as a ServerApp task (run id of new messages)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        assert hasattr(TaskIdentity, attr), _why(
            f"TaskIdentity.{attr}", "flwr", FLWR_PINNED, "flwr_gsgm/simulation/inprocess_grid.py"
        )


def test_flwr_datasets_partitioner_exposes_its_row_assignment():
    """clients/partitioning.py reads the row assignment instead of load_partition (speed).

    (It falls back to ``load_partition`` when the attribute is missing, so a change
    would only slow it down; this test makes the change visible.)
    """
    datasets = pytest.importorskip("datasets")
    from flwr_datasets.partitioner import PathologicalPartitioner

    assert _installed("flwr-datasets").startswith(FLWR_DATASETS_PINNED + "."), (
        f"flwr-datasets {_installed('flwr-datasets')} installed; this test pins {FLWR_DATASETS_PINNED}.x"
    )
    partitioner = PathologicalPartitioner(
        num_partitions=3,
        partition_by="label",
        num_classes_per_partition=1,
        class_assignment_mode="first-deterministic",
    )
    partitioner.dataset = datasets.Dataset.from_dict(
        {"index": list(range(12)), "label": [i % 3 for i in range(12)]}
    )
    _ = partitioner.num_partitions
    why = _why(
        "PathologicalPartitioner._partition_id_to_indices(_determined)",
        "flwr-datasets",
        FLWR_DATASETS_PINNED,
        "clients/partitioning.py (_load_index)",
    )
    assert getattr(partitioner, "_partition_id_to_indices_determined", None) is True, why
    mapping = getattr(partitioner, "_partition_id_to_indices", None)
    assert isinstance(mapping, dict) and sorted(mapping) == [0, 1, 2], why
    for pid in range(3):
        expected = partitioner.load_partition(pid)["index"]
        assert np.asarray(mapping[pid]).tolist() == list(expected), why


def test_flwr_fedavg_metric_aggregation_is_a_weighted_mean():
    """flwr_gsgm/engine/federated_evaluation.py aggregates with FedAvg's own default
    (``strategy_utils.aggregate_metricrecords``, not exported by ``flwr.serverapp.strategy``)."""
    from flwr.app import MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg

    why = _why(
        "flwr.serverapp.strategy.strategy_utils.aggregate_metricrecords",
        "flwr",
        FLWR_PINNED,
        "flwr_gsgm/engine/federated_evaluation.py",
    )
    try:
        from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
    except ImportError as err:
        raise AssertionError(why) from err
    assert FedAvg().evaluate_metrics_aggr_fn is aggregate_metricrecords, why
    contents = [
        RecordDict({"m": MetricRecord({"num-examples": 1, "acc": 0.2})}),
        RecordDict({"m": MetricRecord({"num-examples": 3, "acc": 0.6})}),
    ]
    out = aggregate_metricrecords(contents, "num-examples")
    assert dict(out) == pytest.approx({"acc": (0.2 + 3 * 0.6) / 4}), why


# ---------------------------------------------------------------- flwr_gsgm/deploy
def test_flwr_supernode_and_grid_waits_replaced_by_flwr_gsgm_are_there():
    """flwr_gsgm/deploy/flower_waits.py replaces the SuperNode's time.sleep(3) idle wait,
    its time.sleep(0.5) reply poll and the object pull back-off of SuperNode and
    ServerApp (private code of flwr.supernode.start_client_internal and
    flwr.superlink.grid.http_grid)."""
    from flwr_gsgm.deploy.flower_waits import check_grid_pull, check_supernode_waits

    for check in (check_supernode_waits, check_grid_pull):
        try:
            check()
        except RuntimeError as err:
            pytest.fail(f"flwr_gsgm/deploy/flower_waits.py: {err}")


# (module, attribute, parameter names the deploy code passes) of flwr internals.
_DEPLOY_CALLS = [
    ("flwr.supernode.runtime.run_clientapp", "pull_task_input", ["client"]),
    ("flwr.supernode.runtime.run_clientapp", "push_message", ["client", "message", "context"]),
    (
        "flwr.supernode.runtime.run_clientapp",
        "push_task_output",
        ["client", "context", "sub_status", "details"],
    ),
    ("flwr.supercore.heartbeat", "HeartbeatSender", ["heartbeat_fn"]),
    (
        "flwr.supercore.runtime",
        "RuntimeHttpClient.from_server_address",
        ["server_address", "insecure", "root_certificates", "interceptors", "retry_invoker"],
    ),
    ("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor", ["token"]),
    ("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor", ["component_name"]),
    (
        "flwr.supercore.interceptors",
        "SuperExecAuthHttpInterceptor",
        ["master_secret", "protected_methods"],
    ),
    (
        "flwr.supercore.retry",
        "RetryInvoker",
        ["wait_gen_factory", "recoverable_exceptions", "max_tries", "max_time", "should_giveup"],
    ),
    ("flwr.supercore.retry", "exponential", ["base_delay", "max_delay"]),
    (
        "flwr.clientapp.utils",
        "get_load_client_app_fn",
        ["default_app_ref", "app_path", "multi_app"],
    ),
    ("flwr.cli.install", "install_from_fab", ["fab_file", "skip_prompt"]),
    ("flwr.common.config", "get_project_dir", ["fab_id", "fab_version", "fab_hash"]),
    ("flwr.supercore.app_utils", "start_parent_process_monitor", ["parent_pid"]),
    ("flwr.supercore.auth", "load_superexec_auth_secret", ["secret_file"]),
    (
        "flwr.supercore.tls",
        "validate_and_resolve_root_certificates",
        ["root_cert_path", "insecure"],
    ),
    ("flwr.supercore.exit", "add_exit_handler", ["exit_handler"]),
    ("flwr.supernode.cli.flower_supernode", "flower_supernode", []),
    ("flwr.supernode.fleet_http_client", "FleetHttpClient.ActivateNode", ["request"]),
    ("flwr.supernode.fleet_http_client", "FleetHttpClient.RegisterNode", ["request"]),
]


@pytest.mark.parametrize("module, attr, params", _DEPLOY_CALLS, ids=lambda v: str(v))
def test_flwr_runtime_functions_of_the_warm_executor_and_launcher(module, attr, params):
    """flwr_gsgm/deploy/executor.py, app_cache.py and supernode.py build on these."""
    import importlib
    import inspect

    why = _why(f"{module}.{attr}", "flwr", FLWR_PINNED, "flwr_gsgm/deploy/")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{why}: {err}")
    names = set(inspect.signature(obj).parameters)
    assert set(params) <= names, f"{why}: parameters {sorted(names)}, expected {params}"


def test_flwr_runtime_protocol_facts_the_executor_relies_on():
    """Task type, error codes, the SuperNode's answer to a crashed ClientApp (the
    executor killed mid-task) and the Runtime API calls of the executor."""
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE, ErrorCode
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.fab import Fab
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supernode.nodestate.in_memory_nodestate import CLIENT_APP_CRASHED_ERROR

    why = _why("the SuperNode Runtime API", "flwr", FLWR_PINNED, "flwr_gsgm/deploy/executor.py")
    assert TaskType.CLIENT_APP == "flwr-clientapp", why
    assert "supported_task_types" in AcquireTaskRequest.DESCRIPTOR.fields_by_name, why
    for call in ("AcquireTask", "SendTaskHeartbeat", "PullTaskInput", "PushTaskOutput"):
        assert callable(getattr(RuntimeHttpClient, call, None)), f"{why}: {call}"
    assert (
        ErrorCode.LOAD_CLIENT_APP_EXCEPTION,
        ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
        ErrorCode.CLIENT_APP_CRASHED,
    ) == (1, 2, 8), why
    assert CLIENT_APP_CRASHED_ERROR.code == ErrorCode.CLIENT_APP_CRASHED, why
    assert CLIENT_APP_CRASHED_ERROR.reason == "ClientApp stopped responding.", why
    # docs/DEPLOYMENT.md: an executor killed mid-task is answered for after 60 s.
    assert HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL == 60, why
    assert {"hash_str", "content"} <= set(Fab.__dataclass_fields__), why


def test_flwr_supernode_start_and_task_input_code_the_deploy_hooks_rely_on():
    """supernode.py's report_refused_activation wraps FleetHttpClient.ActivateNode and
    RegisterNode, which Flower's connection code calls through the retry invoker that
    SIGINTs its own process on a 401 (hence the hook) and reports any other exception
    with exit code 305; executor.py watches the PullObject calls of pull_task_input by
    setting client.PullObject on its own client."""
    import inspect

    from flwr.supercore.retry import http_retry
    from flwr.supernode import fleet_http_connection
    from flwr.supernode.runtime.run_clientapp import pull_task_input

    why = _why(
        "the SuperNode's activation and task-input code",
        "flwr",
        FLWR_PINNED,
        "flwr_gsgm/deploy/supernode.py and executor.py",
    )
    connection = inspect.getsource(fleet_http_connection.http_request_response)
    assert "client.ActivateNode," in connection and "client.RegisterNode," in connection, why
    assert "ExitCode.SUPERNODE_CONNECTION_ERROR" in connection, why
    retry = inspect.getsource(http_retry.make_simple_http_retry_invoker)
    assert "UNAUTHORIZED" in retry and "signal.SIGINT" in retry, why
    assert "client.PullObject" in inspect.getsource(pull_task_input), why
