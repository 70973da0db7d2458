"""`make demo`: SmolLM2 with pipeline 2 x tensor 3 on a local Kubernetes, answering through its Service.

Starts the local cluster (three Nodes run by the node agent) with the CRDs and the operator as the
Helm chart configures it (webhook on), applies examples/smollm2.yaml, shows the pods and groups
while the InferenceCluster becomes Ready, and sends one chat completion through the client
Service with the `openai` client. `make demo-down` stops everything.

    python -m e2e.demo up | down
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai

from e2e import local_cluster
from e2e.ic_progress import wait_until_ready
from tessera.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2.yaml"
NAMESPACE, NAME, SERVICE_PORT = "default", "smollm2", 8000
PREFERRED_LOCAL_PORT = 8000
READY_TIMEOUT_SECONDS = 1200
QUESTION = "What is the capital of France? Answer in one sentence."


def _local_port() -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", PREFERRED_LOCAL_PORT))
            return PREFERRED_LOCAL_PORT
        except OSError:
            return free_port()


class Kubectl:
    """kubectl against the cluster a background `e2e.local_cluster up` recorded."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.argv = [str(Path(info["bin"]) / "kubectl"), "--kubeconfig", info["kubeconfig"]]
        self.kubeconfig, self.bin = info["kubeconfig"], info["bin"]

    def run(self, *args: str) -> str:
        return subprocess.run([*self.argv, *args], check=True, capture_output=True, text=True).stdout

    def get_json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))


def up() -> int:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print("make demo needs root and iproute2: pods run in network and mount namespaces of their own")
        return 1
    info = local_cluster.recorded_cluster()
    if info is not None:
        print(f"reusing the local cluster that is already up ({local_cluster.pointer_file()})")
    else:
        print("starting the local cluster: etcd, kube-apiserver, controller-manager, scheduler,")
        print("the node agent (3 Nodes), the CRDs and the operator (chart settings, webhook on) ...")
        expose = f"{NAMESPACE}/{NAME}:{SERVICE_PORT}={_local_port()}"
        if local_cluster.up_in_background(["--nodes", "3", "--operator", "--expose", expose]) != 0:
            return 1
        info = local_cluster.recorded_cluster()
        if info is None:
            print("the local cluster stopped as soon as it was up: see the log above")
            return 1
    base_url = info["services"].get(f"{NAMESPACE}/{NAME}:{SERVICE_PORT}")
    if base_url is None:
        print("the running cluster does not expose the demo's Service: `make demo-down` first")
        return 1
    kubectl = Kubectl(info)
    print(kubectl.run("apply", "-n", NAMESPACE, "-f", str(EXAMPLE)), end="")
    # The client Service selects the leaders directly: the demo shows the ranks' own answers
    # (the router runs on this cluster too: tests/e2e's router test).
    router_off = json.dumps({"spec": {"router": {"enabled": False}}})
    kubectl.run("patch", "ic", NAME, "-n", NAMESPACE, "--type", "merge", "-p", router_off)
    print("waiting for 6 rank pods (2 stages x 3 TP ranks) to rendezvous and warm up ...")
    took = wait_until_ready(
        kubectl.get_json, NAMESPACE, NAME, READY_TIMEOUT_SECONDS, report=print, interval=2
    )
    print(f"Ready after {took:.0f}s\n")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="not-needed", max_retries=3)
    started = time.monotonic()
    reply = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=48, temperature=0
    )
    print(f"> {QUESTION}")
    print(f"< {reply.choices[0].message.content}  ({time.monotonic() - started:.1f}s)\n")
    print(kubectl.run("get", "ic", "-n", NAMESPACE))
    print(
        "More requests (OpenAI API, through the client Service):\n"
        f"  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\'\n'
        "kubectl against this cluster:\n"
        f"  export KUBECONFIG={kubectl.kubeconfig} PATH={kubectl.bin}:$PATH\n"
        f"  kubectl get ic,pods -n {NAMESPACE}\n"
        f"Operator log: {info.get('operator_log', '-')}\n"
        "Tear everything down: make demo-down"
    )
    return 0


def down() -> int:
    return local_cluster.down()


def main(argv: list[str]) -> int:
    if argv == ["up"]:
        return up()
    if argv == ["down"]:
        return down()
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
