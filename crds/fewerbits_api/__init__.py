"""fewerbits_api: the API and every contract the operator, the quantization Job and the serving
runtime share, each defined once.

* ``quantizedmodel``, ``policy``, ``conditions``: the custom resources and their status;
* ``artifact``: artifact keys, the manifest and ``Manifest.parse`` (every reader's checks);
* ``jobcontract``: what the operator hands the quantization Job;
* ``formats``: format facts and ``cc_verdict`` (planner and launcher);
* ``datasets``: built-in dataset names and the sha256 of each shipped file;
* ``s3errors``: what kind of failure an S3 error is;
* ``names``: object, file, Secret-key and termination-message names (standard library only).
"""
