"""GPU readiness: ``python -m attnops gpu-report`` (:mod:`.report`) validates and times every GPU path in one run;
GPU benchmark suites join it by :func:`.suites.register_gpu_suite`."""
