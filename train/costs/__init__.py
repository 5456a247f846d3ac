"""What a run costs and how fast it goes.

metrics                 FLOP counts, MFU and device memory
devices                 the device table: peak FLOP/s, price, power, with their sources
energy                  energy meters: NVML, or power x time
hardware                this run's devices, precision, peak, price and energy meter
precision               the compute precision and what it changes (master weights, gradient communication)
windows                 which stretch of a run each time, energy and cost figure covers
memory                  the memory anatomy of a step: parameters, optimizer state, activations
memory_budget           whether a step fits in memory, asked before anything is compiled
compiled                what XLA's compiled executables say (kernels per optimizer step)
measured_utilization    utilization measured by profiler traces, for reports
"""
