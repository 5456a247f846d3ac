"""What a run costs and how fast it goes.

metrics                 FLOP counts, the device table (peak FLOP/s, price, power), energy meters
hardware                this run's devices, precision, peak, price and energy meter
memory                  the memory anatomy of a step: parameters, optimizer state, activations
compiled                what XLA's compiled executables say (kernels per optimizer step)
measured_utilization    utilization measured by profiler traces, for reports
"""
