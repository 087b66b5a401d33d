"""The deploy/ files without a running deployment (seconds): certificates, SuperNode
keys in the format Flower 1.42 loads, the deployment run config, the unit template."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tomli
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve

from flwr_gsgm.config.run_config import parse_run_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def run(*args: str, env: dict | None = None) -> str:
    done = subprocess.run(
        ["bash", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_certificates_for_loopback(tmp_path):
    run(str(DEPLOY / "make_certs.sh"), str(tmp_path / "certs"), "DNS:superlink.lan")
    certs = tmp_path / "certs"
    assert {p.name for p in certs.iterdir()} == {"ca.crt", "ca.key", "server.pem", "server.key"}
    assert (certs / "server.key").stat().st_mode & 0o077 == 0
    check = subprocess.run(
        ["openssl", "verify", "-CAfile", str(certs / "ca.crt"), str(certs / "server.pem")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr
    san = subprocess.run(
        ["openssl", "x509", "-in", str(certs / "server.pem"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
    ).stdout
    for name in ("IP Address:127.0.0.1", "DNS:localhost", "DNS:superlink.lan"):
        assert name in san


def _check_key_pair(private: Path) -> None:
    key = load_ssh_private_key(private.read_bytes(), None)  # what flower-supernode does
    assert isinstance(key, ec.EllipticCurvePrivateKey) and uses_nist_ec_curve(key.public_key())
    public = load_ssh_public_key(Path(f"{private}.pub").read_bytes())  # `flwr supernode register`
    assert public.public_numbers() == key.public_key().public_numbers()
    assert private.stat().st_mode & 0o077 == 0


def test_node_keys_in_flower_format(tmp_path):
    out = run(str(DEPLOY / "make_node_keys.sh"), "-o", str(tmp_path / "keys"), "2")
    assert out.count("created") == 2
    for name in ("node-0", "node-1"):
        _check_key_pair(tmp_path / "keys" / name)
    before = (tmp_path / "keys" / "node-0").read_bytes()
    assert "kept" in run(str(DEPLOY / "make_node_keys.sh"), "-o", str(tmp_path / "keys"), "node-0")
    assert (tmp_path / "keys" / "node-0").read_bytes() == before  # not overwritten without -f


def test_node_keys_without_ssh_keygen(tmp_path):
    """A board without OpenSSH's ssh-keygen: the Python fall-back writes the same format."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "realpath", "mkdir", "chmod", "rm", "basename"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    done = subprocess.run(
        [
            str(bin_dir / "bash"),
            str(DEPLOY / "make_node_keys.sh"),
            "-o",
            str(tmp_path / "keys"),
            "board-7",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(bin_dir), "VENV": str(tmp_path / "no-venv"), "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _check_key_pair(tmp_path / "keys" / "board-7")


def test_deployment_run_config_is_valid():
    overrides = tomli.loads((DEPLOY / "run-config.toml").read_text())
    cfg = parse_run_config(overrides)
    assert cfg["virtual-clock"] is False
    assert cfg["dispatch-timeout"] < cfg["message-ttl"]  # parse_run_config checks it too
    # Each poll is an HTTPS request to the SuperLink: 20 per second at most.
    assert cfg["poll-interval"] == 0.05
    assert cfg["prefetch"] is False


def test_supernode_requirements_and_unit_template():
    requirements = (DEPLOY / "requirements-supernode.txt").read_text()
    lines = [line.split("#")[0].strip() for line in requirements.splitlines()]
    names = {line.split("[")[0].split(">")[0].split("=")[0].split("<")[0] for line in lines if line}
    assert names == {"flwr", "numpy", "cachetools", "torch", "torchvision", "flwr-datasets"}
    assert "simulation" not in "".join(lines)
    unit = (DEPLOY / "flwr-supernode.service").read_text()
    for needle in (
        "ExecStart=/opt/flwr/venv/bin/flwr-gsgm-supernode $CLIENTAPP_FLAGS",
        'Environment="CLIENTAPP_FLAGS=--warm-executor --preload torch"',  # warm by default
        "Environment=FLWR_TELEMETRY_ENABLED=0",
        "Environment=FLWR_DISABLE_UPDATE_CHECK=1",
        "Environment=FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1",
        "--port 9094",
        "--root-certificates",
        "--auth-supernode-private-key",
        "partition-id=${PARTITION_ID}",
        "num-partitions=${NUM_PARTITIONS}",
        "cache-dir=",
        "Restart=always",
        "WantedBy=multi-user.target",
    ):
        assert needle in unit


def test_start_supernode_refuses_an_unknown_clientapp_mode(tmp_path):
    """CLIENTAPP_MODE picks the SuperNode command: warm (default) or per-message."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.env").write_text("NUM_PARTITIONS=2\nADDRESS=127.0.0.1:1\n")
    done = subprocess.run(
        ["bash", str(DEPLOY / "start_supernode.sh"), "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "RUN_DIR": str(tmp_path / "run"),
            "KEY_DIR": str(tmp_path / "keys"),
            "CLIENTAPP_MODE": "threads",
            "REGISTER": "0",
        },
    )
    assert done.returncode != 0
    assert "CLIENTAPP_MODE must be warm or per-message, got 'threads'" in done.stderr
    assert not (tmp_path / "run" / "pids").exists()  # nothing was started


def test_supernode_command_by_mode():
    def command(mode: str) -> list[str]:
        done = subprocess.run(
            ["bash", "-c", f'source "{DEPLOY}/lib.sh" && supernode_command'],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "CLIENTAPP_MODE": mode},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    warm = command("warm")
    assert warm[-3:] == ["--warm-executor", "--preload", "torch"]
    assert warm[:1] == ["flwr-gsgm-supernode"] or warm[1:3] == ["-m", "flwr_gsgm.deploy.supernode"]
    assert command("per-message") == ["flower-supernode"]
