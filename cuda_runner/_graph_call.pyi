"""Types of the C graphed host call (cuda_runner/native/graph_call.c)."""

from typing import Any

class GraphCall:
    def __init__(
        self, *, launch: int, synchronize: int, current: int, make_current: int, graph: int | None, stream: int | None, context: int | None,
        inputs: list[tuple[str, Any, tuple[int, ...], int, int, tuple[int, int, int] | None, tuple[int, int, int] | None]],
        outputs: list[tuple[str, Any, tuple[int, ...], int, int]], array_type: type, empty: Any, fail: Any, keep: object,
    ) -> None: ...
    def run(self, inputs: dict[str, Any]) -> dict[str, Any] | None: ...
    def close(self) -> None: ...
