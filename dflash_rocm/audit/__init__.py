"""The compiled-kernel audit behind ``dflash-rocm inspect``.

No GPU runs in CI, but everything that decides the kernels' speed except the clock is
visible without one: the launch tables fix grids, tiles and bytes, and Triton compiles
for every target on a CPU. The audit captures every launch the real host code makes for
the shapes the tables serve (:mod:`.sweep`), compiles each with the specialisation a real
launch gets (:mod:`.compiler`), reads registers, spills, occupancy and the hot loop's
instruction mix from the machine code (:mod:`.isa`), and models each launch's time
against the hardware floor (:mod:`.traffic`, :mod:`.model`), every assumption printed
beside the result (:mod:`.targets`). The compile facts are tested; the times are a model.
"""
