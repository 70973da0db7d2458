from pathlib import Path
from typing import Any

from tessera_operator import crdgen

ROOT = Path(__file__).resolve().parents[2]


def walk(node: Any, path: str = "") -> list[tuple[str, str]]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((path, key))
            found += walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for item in node:
            found += walk(item, path)
    return found


def test_committed_crd_matches_the_pydantic_models() -> None:
    # The chart holds a copy, not a symlink: GitOps tools (Flux) drop symlinks from a Git source.
    for folder in ("crds", "charts/tessera/crds"):
        path = ROOT / folder / crdgen.CRD_FILENAME
        assert not path.parent.is_symlink() and not path.is_symlink(), f"{folder} must be a real copy"
        assert path.read_text() == crdgen.render(), f"{folder} is stale: run `make crds`"


def test_schema_is_structural() -> None:
    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    keys = {key for _, key in walk(schema)}
    assert not keys & {"$ref", "anyOf", "oneOf", "allOf", "$defs", "title", "const"}
    # exclusive bounds are OpenAPI v3.0 booleans beside their bound, never JSON Schema's numbers
    exclusive = [path for path, key in walk(schema) if key in ("exclusiveMinimum", "exclusiveMaximum")]
    assert exclusive, "the schema has exclusive bounds (targetQueueDepth, topP)"
    for node_path in exclusive:
        node = schema
        for part in node_path.strip(".").split("."):
            node = node[part]
        assert node.get("exclusiveMinimum", True) is True and "minimum" in node, node_path
        assert node.get("exclusiveMaximum", True) is True, node_path
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["model"]
    par = spec["properties"]["parallelism"]
    assert par["default"] == {}
    assert par["properties"]["tensor"] == {
        "default": 1,
        "description": "Tensor-parallel ranks per pipeline stage.",
        "maximum": 64,
        "minimum": 1,
        "type": "integer",
    }
    expert = par["properties"]["expertParallel"]
    assert (expert["type"], expert["default"]) == ("boolean", False)
    assert "--enable-expert-parallel" in expert["description"]
    assert spec["properties"]["placement"]["properties"]["mode"]["enum"] == ["preferred", "required", "none"]
    assert spec["properties"]["template"]["properties"]["tolerations"]["items"] == {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    assert "default" not in spec["properties"]["autoscaling"]  # absent means off
    kv = spec["properties"]["engine"]["properties"]["kvCacheMemory"]
    assert kv["x-kubernetes-int-or-string"] is True and "type" not in kv and kv["minimum"] == 0
    target = spec["properties"]["autoscaling"]["properties"]["targetQueueDepth"]
    assert target["minimum"] == 0 and target["exclusiveMinimum"] is True


def test_scale_subresource_printer_columns_and_names() -> None:
    crd = crdgen.build_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert version["subresources"]["status"] == {}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Replicas", "Ready", "TP", "PP", "Model", "Age"]
    assert crd["spec"]["names"]["shortNames"] == ["ic"]
    assert crd["metadata"]["name"] == "inferenceclusters.tessera.dev"


def test_crdgen_cli_writes_the_file(tmp_path: Path) -> None:
    crdgen.main(["--out", str(tmp_path)])
    assert (tmp_path / crdgen.CRD_FILENAME).read_text() == crdgen.render()
