"""The P4 switch program (p4/aggnet/*.p4), its generated definitions,
compiled artifacts and P4Runtime control plane; installed as aggnet.p4.

From a checkout's root this directory can also be found as a top-level
``p4``, the name under which P4Runtime's generated protobuf modules live
(``p4.v1``, ``p4.config.v1``); extending the path lets both resolve.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
