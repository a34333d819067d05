"""The ctypes binding's structures match UCX 1.22's C layout, and statuses map to errors.

The expected sizes and offsets were printed by a C program compiled against the libucx
wheel's 1.22 headers (``sizeof``/``offsetof``); the wheel is built without parameter
checks, so a drifted layout would corrupt memory rather than fail, hence this pin.
"""

from __future__ import annotations

import ctypes

import pytest
from kvwire_ucx import _ucp

from kvwire.errors import TransportError

LAYOUT: dict[str, tuple[int, dict[str, int]]] = {
    "UcpParams": (88, {"features": 8, "request_size": 16, "mt_workers_shared": 48,
                       "estimated_num_eps": 56, "name": 72, "node_local_id": 80}),
    "UcpWorkerParams": (200, {"thread_mode": 8, "cpu_mask": 16, "events": 144,
                              "user_data": 152, "event_fd": 160, "flags": 168, "name": 176,
                              "am_alignment": 184, "client_id": 192}),
    "UcpWorkerAttr": (80, {"thread_mode": 8, "address_flags": 12, "address": 16,
                           "address_length": 24, "max_am_header": 32, "name": 40,
                           "max_debug_string": 72}),
    "UcpContextAttr": (72, {"request_size": 8, "thread_mode": 16, "memory_types": 24,
                            "name": 32, "device_counter_size": 64}),
    "UcpEpParams": (104, {"address": 8, "err_mode": 16, "err_handler": 24, "user_data": 40,
                          "flags": 48, "sockaddr": 56, "conn_request": 72, "name": 80,
                          "local_sockaddr": 88}),
    "UcpMemMapParams": (48, {"address": 8, "length": 16, "flags": 24, "prot": 28,
                             "memory_type": 32, "exported_memh_buffer": 40}),
    "UcpRequestParam": (96, {"flags": 4, "request": 8, "cb": 16, "datatype": 24,
                             "user_data": 32, "reply_buffer": 40, "memory_type": 48,
                             "recv_info": 56, "memh": 64, "remote_datatype": 72,
                             "remote": 80, "remote_count": 88}),
    "UcpAmHandlerParam": (32, {"id": 8, "flags": 12, "cb": 16, "arg": 24}),
    "UcpAmRecvParam": (16, {"reply_ep": 8}),
}  # fmt: skip


@pytest.mark.parametrize("struct_name", sorted(LAYOUT))
def test_struct_layout_matches_ucx_1_22(struct_name: str) -> None:
    struct = getattr(_ucp, struct_name)
    size, offsets = LAYOUT[struct_name]
    assert ctypes.sizeof(struct) == size
    for field, offset in offsets.items():
        assert getattr(struct, field).offset == offset, field


def test_status_is_one_signed_byte() -> None:
    # ucs_status_t is declared UCS_S_PACKED: reading it as an int would see garbage bytes.
    assert ctypes.sizeof(_ucp.ucs_status_t) == 1
    assert _ucp.ucs_status_t(-25).value == -25


def test_status_names_cover_ranges() -> None:
    assert _ucp.status_name(-6) == "UCS_ERR_UNREACHABLE"
    assert _ucp.status_name(-45).startswith("UCS_ERR_LINK_FAILURE")
    assert _ucp.status_name(-70).startswith("UCS_ERR_ENDPOINT_FAILURE")


def test_check_raises_transport_error_with_status_name() -> None:
    lib = _ucp.load_library()
    _ucp.check(lib, _ucp.UCS_OK, "nothing")
    with pytest.raises(TransportError) as info:
        _ucp.check(lib, -6, "ucp_ep_create")
    assert info.value.status == "UCS_ERR_UNREACHABLE"
    assert "ucp_ep_create" in str(info.value)


def test_error_pointer_decoding() -> None:
    assert _ucp._pointer_status(None) == _ucp.UCS_OK
    assert _ucp._pointer_status((1 << 64) - 25) == -25
    assert _ucp._pointer_status(0x7F0000001000) is None


def test_library_is_ucx_1_22_or_newer() -> None:
    major, minor = (int(x) for x in _ucp.load_library().version.split(".")[:2])
    assert (major, minor) >= (1, 22)
