"""Pictures of structure: which processes exist and how they talk, drawn with graphviz.

What it teaches: before measuring a distributed run it helps to see its shape. A
`fsdp_lab.Cluster` is a notebook process, a fork server the ranks are forked from, a rendezvous
file, N rank processes, pipes from the notebook to each rank, and a process group joining the
ranks; `cluster_diagram` draws exactly that, the picture `torch.distributed`'s docs describe in
words (init_process_group over a store, then collectives among ranks).

`wrap_diagram` draws the other picture the weight-tying lab needs: a model's module tree with
its wrap units as boxes around it and every tied parameter as an ellipse linked to the modules
that use it, so the learner sees *why* a wrap plan is valid or not before anything runs.

One module per picture: `cluster` (the processes of a Cluster), `wrap` (wrap units and tied
weights), `pipeline` (a pipeline's stages and how its initialisation travels), `mesh` (a
hybrid-sharding mesh and the link each collective uses), `parallelism` (data, context,
pipeline and tensor parallelism side by side); `base.Diagram`
is what they return. Drawing needs graphviz's `dot` program, which is
an OS package, not a pip package. Without it a `Diagram` still works: Jupyter shows the DOT source with a one-line note instead of failing, so a
missing system package never breaks a lesson.
"""

from fsdp_lab.diagrams.base import MISSING_DOT_MESSAGE, Diagram, _explain_missing_dot_once, has_dot
from fsdp_lab.diagrams.cluster import cluster_diagram
from fsdp_lab.diagrams.mesh import mesh_diagram
from fsdp_lab.diagrams.parallelism import parallelism_diagram
from fsdp_lab.diagrams.pipeline import pipeline_diagram
from fsdp_lab.diagrams.wrap import wrap_diagram

__all__ = [
    "MISSING_DOT_MESSAGE",
    "Diagram",
    "_explain_missing_dot_once",
    "cluster_diagram",
    "has_dot",
    "mesh_diagram",
    "parallelism_diagram",
    "pipeline_diagram",
    "wrap_diagram",
]
