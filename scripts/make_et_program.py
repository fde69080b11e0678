#!/usr/bin/env python3
"""Export a real ExecuTorch CUDA program to test cuda-runner with (GPU machine).

A model with two inputs and two outputs and a dynamic batch dim, lowered with
ExecuTorch's CudaPartitioner, written as model.pte + aoti_cuda_blob.ptd, with
io.npz holding inputs and eager outputs under the names cuda-runner gives a
program's tensors (input_0, input_1, output_0, output_1).

Needs a CUDA build of PyTorch, a GPU (Inductor compiles and autotunes on it),
and the executorch package (its export side is pure Python; scripts/gpu-test.sh
installs it from wheels carried to the machine). If the dynamic export fails,
the script says why and exports with static shapes instead.

    python scripts/make_et_program.py --out-dir et_two_io
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="et_two_io")
    args = parser.parse_args()

    import numpy as np
    import torch
    from torch.export import Dim

    if not torch.cuda.is_available():
        print("needs a CUDA build of PyTorch and a visible GPU", file=sys.stderr)
        return 2
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    class TwoInTwoOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.Linear(16, 24)
            self.gate = torch.nn.Linear(16, 24)
            self.out = torch.nn.Linear(24, 6)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = torch.tanh(self.mix(x)) * torch.sigmoid(self.gate(y))
            return self.out(hidden), hidden.sum(dim=1)

    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    example = (torch.randn(4, 16), torch.randn(4, 16))
    os.makedirs(args.out_dir, exist_ok=True)
    attempts = [("dynamic batch 1..32", {"x": {0: Dim("batch", min=1, max=32)}, "y": {0: Dim("batch", min=1, max=32)}}), ("static", None)]
    log = {}
    for label, dynamic_shapes in attempts:
        started = time.time()
        try:
            exported = torch.export.export(model, example, dynamic_shapes=dynamic_shapes)
            edge = to_edge_transform_and_lower(
                exported,
                partitioner=[CudaPartitioner([CudaBackend.generate_method_name_compile_spec("forward")])],
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
            )
            program = edge.to_executorch()
        except Exception as error:  # record why, then try the next way
            log[label] = f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            traceback.print_exc()
            continue
        with open(os.path.join(args.out_dir, "model.pte"), "wb") as handle:
            program.write_to_file(handle)
        program.write_tensor_data_to_file(args.out_dir)
        batch = 7 if dynamic_shapes else 4
        inputs = (torch.randn(batch, 16), torch.randn(batch, 16))
        with torch.no_grad():
            outputs = model(*inputs)
        np.savez(os.path.join(args.out_dir, "io.npz"), input_0=inputs[0].numpy(), input_1=inputs[1].numpy(),
                 output_0=outputs[0].numpy(), output_1=outputs[1].numpy())
        log[label] = f"exported in {time.time() - started:.1f} s"
        log["shapes"] = label
        break
    from importlib.metadata import version

    log.update(torch=torch.__version__, executorch=version("executorch"), gpu=torch.cuda.get_device_name())
    with open(os.path.join(args.out_dir, "export.json"), "w") as handle:
        json.dump(log, handle, indent=1)
    print(json.dumps(log))
    return 0 if "shapes" in log else 1


if __name__ == "__main__":
    sys.exit(main())
