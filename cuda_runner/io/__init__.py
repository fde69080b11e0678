"""Inputs and outputs: .npy/.npz files, inline literals, generated inputs."""
