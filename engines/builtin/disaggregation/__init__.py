"""Prefill/decode disaggregation (`engine.disaggregation=pd`): prefill instances compute each
prompt's K/V and hand them to decode instances, which generate (vLLM's disaggregated prefill
with KV connectors, SGLang's PD disaggregation; docs/disaggregation.md).

    router.py      the engine the harness and the server drive: routes each request to a
                   prefill and a decode instance, merges their events, keeps the time
    processes.py   the instance processes as the router holds them: start, message, end
    instance.py    one instance: a process running a plain LLMEngine in the prefill or decode
                   role, its K/V leaving or arriving through a connector
    connectors.py  how K/V move between instances: shared memory on one host, or gloo
    messages.py    what the router and the instances say to each other
"""
