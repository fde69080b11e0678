"""Types of the C device call (cuda_runner/native/device_call.c)."""

from typing import Any

def layout() -> tuple[int, int, int]: ...

class DeviceCall:
    failed_index: int
    run_status: int
    live_keepers: int
    def __init__(
        self, *, helper: int, run: int, container: int, stream: int | None, device_type: int, device_index: int, input_dtypes: list[int],
        output_count: int, delete: int, array_type: type, memory_type: Any, pointer_type: Any, dtypes: dict[int, tuple[Any, int]],
        keep: object, error: type[BaseException],
    ) -> None: ...
    def run(self, arrays: list[Any]) -> list[Any] | int | None: ...
    def close(self, on_last: Any) -> None: ...
