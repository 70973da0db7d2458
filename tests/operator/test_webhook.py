import kopf
import pytest

from tessera_operator import webhook

INVALID = {
    "model": {"source": "smollm2-135m-instruct"},
    "parallelism": {"tensor": 1, "sequenceParallel": True},
}
VALID = {"model": {"source": "smollm2-135m-instruct"}}


async def test_create_and_update_are_judged_naming_the_field() -> None:
    for operation in webhook.OPERATIONS:
        with pytest.raises(kopf.AdmissionError, match=r"spec\.parallelism\.sequenceParallel"):
            await webhook.validate_inference_cluster(INVALID, "demo", {"metadata": {}}, operation)
    await webhook.validate_inference_cluster(VALID, "demo", {"metadata": {}}, "CREATE")


async def test_delete_always_passes() -> None:
    # Even if a hand-written configuration sends it: an object must always be deletable.
    await webhook.validate_inference_cluster(INVALID, "demo", {"metadata": {}}, "DELETE")


async def test_a_generate_name_leaves_room_for_the_random_suffix() -> None:
    body = {"metadata": {"generateName": "a" * 38}}
    with pytest.raises(kopf.AdmissionError, match=r"metadata\.name"):
        await webhook.validate_inference_cluster(VALID, None, body, "CREATE")
    await webhook.validate_inference_cluster(VALID, None, {"metadata": {"generateName": "demo-"}}, "CREATE")
