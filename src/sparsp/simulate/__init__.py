"""``sparsp simulate``: the cost model (``sparsp.cost``) swept over strategies and G on a profile.

``options``: what a run is asked to do (``SimulateConfig``) and its masks; ``job``: the
``sparsp simulate`` run (sweep over G with each kind of step and the run, validation);
``plots``: its JSON and PNGs; ``meshes``: with ``--mesh``, the model's step on a device mesh;
``layers``: with a density profile, the whole model's step, layer by layer on calibrated
masks; ``calibrate``:
``--fit-profile``, a machine profile fitted to ``bench transport`` and ``bench kernel``
results; ``opcount``: ``--count-ops``, the host's op counts the model charges (``cost.ops``)
recounted on the code; ``cli``: the command line. The model itself is ``sparsp.cost``; this
package resolves each strategy's registered facts once and hands them to it. Method, figures
and sources: docs/simulate.md.
"""
