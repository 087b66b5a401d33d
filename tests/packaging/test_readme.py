"""README.md: at most 250 lines, opening with the two commands, its imports real.

Issue 25 item 5: the first screen holds what a new user runs (`make run`, `make test`);
the reference lives in docs/ (docs/REFERENCE.md, generated; docs/USER_GUIDE.md).
"""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of ``text``, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def test_fenced_blocks_hand_made():
    text = "# t\n\n```bash\nmake run\n```\n\ntext\n\n```\nplain\n```\n"
    assert fenced_blocks(text) == [("bash", "make run\n"), ("", "plain\n")]


def test_readme_is_at_most_250_lines():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_readme_opens_with_the_two_commands():
    lines = README.splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    # The first thing after the title is the bash block of the two commands.
    assert lines[2] == "```bash"
    first = fenced_blocks(README)[0]
    commands = [ln.split("#")[0].strip() for ln in first[1].splitlines()]
    assert first[0] == "bash" and commands == ["make run", "make test"]
    # Both are targets of the Makefile, and CI runs the second as written.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()


def imports_of(text: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``from flwr_gsgm... import ...`` line in the code blocks
    of ``text`` (a diff's ``+`` lines included)."""
    found = []
    for _, body in fenced_blocks(text):
        for line in body.splitlines():
            match = re.match(r"^\+?\s*from (flwr_gsgm[\w.]*) import ([\w, ]+)$", line)
            if match:
                found.append((match[1], [n.strip() for n in match[2].split(",")]))
    return found


def test_imports_of_hand_made():
    text = "```diff\n-from flwr import A\n+from flwr_gsgm import GSGM, X\n```\n"
    assert imports_of(text) == [("flwr_gsgm", ["GSGM", "X"])]


def test_every_flwr_gsgm_import_the_readme_shows_works():
    found = imports_of(README)
    assert ("flwr_gsgm", ["GSGM", "FederatedEvaluation"]) in found  # the FedAvg diff
    for module, names in found:
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name), f"README: from {module} import {name} fails"
    from flwr_gsgm import FederatedEvaluation
    from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation as defined

    assert FederatedEvaluation is defined


def diff_after(text: str, hunk: int) -> str:
    """The code after the change of hunk ``hunk`` (0-based) of the README's ``diff`` block:
    its context and ``+`` lines, dedented."""
    body = next(b for lang, b in fenced_blocks(text) if lang == "diff")
    hunks = re.split(r"^@@.*\n", body, flags=re.M)
    kept = [ln[1:] for ln in hunks[hunk].splitlines() if ln[:1] in (" ", "+", "")]
    return textwrap.dedent("\n".join(kept))


def test_diff_after_hand_made():
    text = "```diff\n a = 1\n-b = 2\n+b = 3\n@@\n     x = a\n+    y = b\n```\n"
    assert diff_after(text, 0) == "a = 1\nb = 3"
    assert diff_after(text, 1) == "x = a\ny = b"


def test_the_fedavg_to_gsgm_diff_runs_as_written():
    """The "after" of the README's diff, on the in-process grid with 3 FedAvg-style nodes.

    Flower's quickstart: 2 rounds, fraction-evaluate 0.5, learning-rate 0.1. The model is
    one linear layer; each node takes one SGD step towards zero at the lr it was sent and
    returns its weights (FedAvg's ClientApp: no query handler, no partition-id).
    """
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from flwr_gsgm import InProcessGrid

    lrs: list[float] = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        lr = float(msg.content["config"]["lr"])
        lrs.append(lr)
        state = {k: v * (1 - lr) for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        metrics = MetricRecord({"num-examples": 10, "train_loss": 0.5})
        content = RecordDict({"arrays": ArrayRecord(state), "metrics": metrics})
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({"num-examples": 10, "eval_acc": 0.5})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    evaluated: list[int] = []

    def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(server_round)
        return MetricRecord({"accuracy": 0.5, "loss": 1.0})

    imports = [ln for ln in diff_after(README, 0).splitlines() if "pytorchexample" not in ln]
    namespace = {"Net": lambda: torch.nn.Linear(2, 1), "global_evaluate": global_evaluate}
    exec("\n".join(imports), namespace)
    assert namespace["GSGM"].rule == "gsgm"  # from flwr_gsgm import GSGM, FederatedEvaluation
    run_config = {"fraction-evaluate": 0.5, "num-server-rounds": 2, "learning-rate": 0.1}
    with InProcessGrid(app, 3, run_config={}) as grid:
        namespace["grid"] = grid
        namespace["context"] = Context(
            run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
        )
        exec(diff_after(README, 1), namespace)
    result = namespace["result"]
    # 2 rounds x 3 nodes = 6 client trainings, each at the run config's lr; an
    # evaluation per "round" of 3 updates; federated: max(int(3 x 0.5), 1) = 1 node.
    assert lrs == [0.1] * 6
    assert evaluated == [0, 3, 6] == sorted(result.evaluate_metrics_serverapp)
    assert sorted(result.evaluate_metrics_clientapp) == [3, 6]
    # Weights mode: GSGM steps at each cycle's close (apply_at "auto"); a cycle closes at
    # ceil(0.5 x 3) = 2 contributions, and a node that contributed waits for the close.
    assert result.rows[-1]["updates"] == 6 and result.rows[-1]["version"] == 3
