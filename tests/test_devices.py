"""CUDA_VISIBLE_DEVICES parsing and CUDA -> NVML matching by UUID."""

from __future__ import annotations

import pytest
from fake_nvml import FakeDevice, FakeMig, FakeNvml

from dpprof.nvml.devices import (
    match_torch_uuid,
    normalize_uuid,
    nvml_index_for_uuid,
    parse_cuda_visible_devices,
    resolve_visible_devices,
    torch_cuda_uuids,
    visible_devices,
)

U0 = "GPU-aaaa0000-1111-2222-3333-444444444444"
U1 = "GPU-aaaa1111-1111-2222-3333-444444444444"
U2 = "GPU-bbbb2222-1111-2222-3333-444444444444"
U3 = "GPU-cccc3333-1111-2222-3333-444444444444"
MIG = "MIG-dddd4444-1111-2222-3333-444444444444"


def indices(value: str | None) -> list[int | None]:
    return [e.index for e in parse_cuda_visible_devices(value).entries]


# --------------------------------------------------------------------------- parsing


def test_unset_means_all_and_empty_means_none() -> None:
    unset = parse_cuda_visible_devices(None)
    assert unset.all_devices and unset.kind == "all" and unset.entries == ()
    empty = parse_cuda_visible_devices("")
    assert not empty.all_devices and empty.kind == "none" and empty.entries == ()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0,1", [0, 1]),
        ("2,1", [2, 1]),  # list order, not numeric order
        ("0,2,-1,1", [0, 2]),  # the CUDA guide's own example: -1 ends the list
        ("1gpu2,2ampere", [1, 2]),  # strtoul: the leading number counts
        (" 1, 2", [1, 2]),
        ("0,,1", [0]),  # an empty entry is invalid and ends the list
        ("a,0", []),
        ("3,x,1", [3]),
        ("+1", [1]),
    ],
)
def test_integer_lists_are_read_like_cuda(value: str, expected: list[int]) -> None:
    assert indices(value) == expected


def test_invalid_entry_is_reported_in_notes() -> None:
    parsed = parse_cuda_visible_devices("0,2,-1,1")
    assert any("'-1'" in note for note in parsed.notes)


def test_repeated_index_means_no_device() -> None:
    parsed = parse_cuda_visible_devices("0,1,0")
    assert parsed.entries == ()
    assert any("twice" in note for note in parsed.notes)


def test_uuid_lists() -> None:
    parsed = parse_cuda_visible_devices("GPU-aaaa1111,GPU-bbbb,1")
    assert parsed.kind == "gpu-uuid"
    assert [e.uuid for e in parsed.entries] == ["GPU-aaaa1111", "GPU-bbbb"]  # "1" ends it
    assert parse_cuda_visible_devices("GPU-a,GPU-a").entries == ()
    assert indices("1,GPU-aaaa1111") == [1]  # an integer list stops at the UUID


def test_mig_strings_new_and_legacy() -> None:
    new = parse_cuda_visible_devices(MIG)
    assert new.kind == "mig"
    assert [(e.kind, e.uuid) for e in new.entries] == [("mig-uuid", MIG)]
    legacy = parse_cuda_visible_devices(f"MIG-{U2}/1/0")
    (entry,) = legacy.entries
    assert (entry.kind, entry.uuid, entry.gpu_instance_id, entry.compute_instance_id) == (
        "mig-legacy",
        U2,
        1,
        0,
    )
    assert parse_cuda_visible_devices(f"MIG-{U2}/x/0").entries == ()


def test_only_the_first_mig_device_is_enumerated() -> None:
    parsed = parse_cuda_visible_devices(f"{MIG},MIG-eeee")
    assert [e.text for e in parsed.entries] == [MIG]
    assert any("single MIG device" in note for note in parsed.notes)


# --------------------------------------------------------------------------- UUID helpers


def test_normalize_uuid_accepts_torch_and_nvml_spellings() -> None:
    bare = U1[4:]
    assert normalize_uuid(bare) == U1
    assert normalize_uuid(bare.upper()) == U1
    assert normalize_uuid(U1.encode()) == U1
    assert normalize_uuid(bare, mig=True) == "MIG-" + bare
    assert normalize_uuid("GPU-123") is None
    assert normalize_uuid(None) is None


def test_match_torch_uuid() -> None:
    nvml_uuids = [U0, U1, MIG]
    assert match_torch_uuid(U1[4:], nvml_uuids) == U1  # torch prints without "GPU-"
    assert match_torch_uuid(U1.upper().replace("GPU-", "gpu-"), nvml_uuids) == U1
    assert match_torch_uuid(MIG[4:], nvml_uuids) == MIG  # a MIG device reports MIG bytes
    assert match_torch_uuid("GPU-" + MIG[4:], nvml_uuids) is None  # prefix given: must agree
    assert match_torch_uuid(U2[4:], nvml_uuids) is None
    assert match_torch_uuid("not-a-uuid", nvml_uuids) is None


def test_torch_cuda_uuids_is_none_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert torch_cuda_uuids() is None


# --------------------------------------------------------------------------- resolution


def four_gpus(**kw: object) -> FakeNvml:
    """Four GPUs whose NVML order is NOT their PCI bus order (as NVML allows)."""
    return FakeNvml(
        [
            FakeDevice(U0, pci_bus_id="00000000:81:00.0", total_bytes=40 * 2**30),
            FakeDevice(U1, pci_bus_id="00000000:01:00.0", total_bytes=40 * 2**30),
            FakeDevice(U2, pci_bus_id="00000000:41:00.0", total_bytes=40 * 2**30),
            FakeDevice(
                U3,
                pci_bus_id="00000000:C1:00.0",
                total_bytes=40 * 2**30,
                mig=[
                    FakeMig(MIG, gpu_instance_id=1, compute_instance_id=0, total_bytes=10 * 2**30)
                ],
            ),
        ],
        **kw,  # type: ignore[arg-type]
    )


def test_unset_lists_every_gpu_in_pci_bus_order() -> None:
    devs = visible_devices(four_gpus(), env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [d.cuda_index for d in devs] == [0, 1, 2, 3]
    assert [d.uuid for d in devs] == [U1, U2, U0, U3]
    assert [d.nvml_index for d in devs] == [1, 2, 0, 3]
    assert all(d.matched and d.reason is None and d.note is None for d in devs)
    assert devs[0].total_memory_bytes == 40 * 2**30
    assert devs[0].pci_bus_id == "00000000:01:00.0"


def test_integers_map_through_pci_order_not_nvml_position() -> None:
    devs = visible_devices(four_gpus(), env={"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(d.cuda_index, d.nvml_index, d.uuid) for d in devs] == [(0, 0, U0), (1, 1, U1)]
    assert {d.matched_by for d in devs} == {"pci-bus-order"}


def test_index_past_the_last_gpu_ends_the_list() -> None:
    found = resolve_visible_devices(four_gpus(), env={"CUDA_VISIBLE_DEVICES": "1,7,0"})
    assert [d.uuid for d in found.devices] == [U2]
    assert any("only 4 GPUs" in note for note in found.notes)


def test_empty_string_shows_no_gpu() -> None:
    assert visible_devices(four_gpus(), env={"CUDA_VISIBLE_DEVICES": ""}) == []


def test_uuid_prefixes_match_one_gpu_or_end_the_list() -> None:
    nvml = four_gpus()
    devs = visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": f"GPU-bbbb,{U0}"})
    assert [(d.nvml_index, d.matched_by) for d in devs] == [(2, "uuid-prefix"), (0, "uuid")]
    ambiguous = resolve_visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": "GPU-cccc,GPU-aaaa"})
    assert [d.uuid for d in ambiguous.devices] == [U3]
    assert any("matches 2 GPUs" in note for note in ambiguous.notes)
    unknown = resolve_visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": "GPU-ffff,GPU-bbbb"})
    assert unknown.devices == []
    assert any("matches no GPU" in note for note in unknown.notes)


def test_same_gpu_twice_through_prefixes_means_no_device() -> None:
    found = resolve_visible_devices(four_gpus(), env={"CUDA_VISIBLE_DEVICES": f"{U2},GPU-bbbb"})
    assert found.devices == []
    assert any("twice" in note for note in found.notes)


def test_mig_devices_match_by_mig_uuid_and_legacy_form() -> None:
    nvml = four_gpus()
    for value in (MIG, f"MIG-{U3}/1/0"):
        (dev,) = visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": value})
        assert dev.mig and dev.uuid == MIG and dev.nvml_index == 3
        assert dev.total_memory_bytes == 10 * 2**30
    missing = resolve_visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": f"MIG-{U3}/2/0"})
    assert missing.devices == [] and any("no such MIG" in n for n in missing.notes)


def test_cuda_reported_uuids_decide() -> None:
    nvml = four_gpus()
    cuda = [U3[4:], U0[4:], MIG[4:], U2[4:].replace("bbbb2222", "99999999")]
    devs = visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": "0,1"}, cuda_uuids=cuda)
    assert [d.nvml_index for d in devs] == [3, 0, 3, None]
    assert [d.matched_by for d in devs[:3]] == ["uuid", "uuid", "uuid"]
    assert devs[2].mig and devs[2].uuid == MIG
    assert devs[3].reason is not None and "no NVML device has UUID" in devs[3].reason


def test_fastest_first_with_mixed_models_is_flagged() -> None:
    mixed = FakeNvml(
        [
            FakeDevice(U0, name="NVIDIA A100", pci_bus_id="0000:01:00.0"),
            FakeDevice(U1, name="NVIDIA T4", pci_bus_id="0000:02:00.0"),
        ]
    )
    devs = visible_devices(mixed, env={})
    assert all(d.note and "FASTEST_FIRST" in d.note for d in devs)
    same = visible_devices(four_gpus(), env={})
    assert all(d.note is None for d in same)


def test_without_nvml_every_device_says_why() -> None:
    nvml = FakeNvml.unavailable("NVML Shared Library Not Found")
    devs = visible_devices(nvml, env={"CUDA_VISIBLE_DEVICES": f"0,{U1}"})
    assert len(devs) == 1  # the UUID entry ends an integer list
    assert devs[0].nvml_index is None
    assert devs[0].reason is not None and "Shared Library Not Found" in devs[0].reason
    found = resolve_visible_devices(nvml, env={})
    assert found.devices == []
    assert any("cannot list the GPUs" in note for note in found.notes)
    (dev,) = visible_devices(nvml, env={}, cuda_uuids=[U1[4:]])
    assert dev.uuid == U1 and not dev.matched


def test_nvml_index_for_uuid() -> None:
    nvml = four_gpus()
    assert nvml_index_for_uuid(nvml, U2[4:]) == 2
    assert nvml_index_for_uuid(nvml, U2) == 2
    assert nvml_index_for_uuid(nvml, "GPU-00000000-0000-0000-0000-000000000000") is None
