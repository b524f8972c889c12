"""TriForce hierarchical speculative decoding as a transformers ``custom_generate`` method.

``model.generate(input_ids, custom_generate="<this repository or folder>", trust_remote_code=True,
triforce_config=...)`` calls `generate` below with every argument given to ``model.generate``: it runs the
hf-triforce package's decoding (``hf_triforce.triforce_generate``) after transformers' own input preparation, exactly
as ``import hf_triforce; model.generate(input_ids, triforce_config=...)`` does.
"""

from transformers import GenerationMixin


def generate(model, *args, triforce_config=None, **kwargs):
    """``triforce_config``: an ``hf_triforce.TriForceConfig``, a dict of its fields (``TriForceConfig.to_dict``; a
    draft model goes in ``assistant_model=``), or None (the default configuration). Every other argument is
    ``model.generate``'s. Returns what ``model.generate(..., triforce_config=...)`` returns: the sequences, or with
    ``return_dict_in_generate=True`` an output carrying ``triforce_stats``."""
    import hf_triforce  # installs triforce_config= on every model's generate

    if isinstance(triforce_config, dict):
        triforce_config = hf_triforce.TriForceConfig.from_dict(triforce_config,
                                                               draft_model=kwargs.pop("assistant_model", None))
    if triforce_config is None:
        draft = kwargs.pop("assistant_model", None)
        triforce_config = hf_triforce.TriForceConfig() if draft is None else hf_triforce.TriForceConfig(draft=draft)
    # the class's generate: a model loaded from this repository has its own generate replaced by this function
    return GenerationMixin.generate(model, *args, custom_generate=hf_triforce.triforce_generate,
                                    triforce_config=triforce_config, **kwargs)
