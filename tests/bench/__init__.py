"""Benchmarks run at full size rarely (the GPU one on a lent GPU only, minutes at a time): a script that
no longer matches mopd's API must fail here, at toy sizes on the CPU, not there (a check of the script,
not a measurement). One file per benchmark, so that the suite's two workers can run them side by side."""
