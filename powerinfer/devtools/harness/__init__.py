"""Programs and stand-ins that drive or measure the engine: the benchmarks behind `powerinfer bench`,
`powerinfer loadtest`, the grammar mask timing, the GPU check and benchmark, and a fake NUMA
topology for the pool's tests. Runs in: the developer's process (and the processes they start)."""
