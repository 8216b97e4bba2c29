"""``sparsp simulate``: the cost model (``sparsp.cost``) swept over strategies and G on a profile.

``job``: the ``sparsp simulate`` run (sweep over G, validation, JSON + PNG); ``layers``: with
a density profile, the whole model's step, layer by layer on calibrated masks; ``calibrate``:
``--fit-profile``, a machine profile fitted to ``bench transport`` and ``bench kernel``
results; ``opcount``: ``--count-ops``, the host's op counts the model charges (``cost.ops``)
recounted on the code; ``cli``: the command line. The model itself is ``sparsp.cost``; this
package resolves each strategy's registered facts once and hands them to it. Method, figures
and sources: docs/simulate.md.
"""
