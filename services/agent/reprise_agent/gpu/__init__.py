"""GPU health backends: real NVML and a simulator with fault injection, behind one interface."""
