"""The runtime: libtorch's shim, model libraries, containers, devices and streams."""
