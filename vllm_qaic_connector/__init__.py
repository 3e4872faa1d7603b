"""vLLM KV-connector plugin: prefill->decode KV handoff (vLLM or QAIC decode)."""

import contextlib

CONNECTOR_NAME = "QAICConnector"


def register() -> None:
    """Entry point of the `vllm.general_plugins` group: registers the connector with vLLM,
    and with Dynamo's vLLM worker (``python -m dynamo.vllm``) where Dynamo is installed."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as Factory

    # vLLM loads general plugins once per process, but a second call must stay harmless.
    if CONNECTOR_NAME not in Factory._registry:
        Factory.register_connector(CONNECTOR_NAME, "vllm_qaic_connector.connector", CONNECTOR_NAME)
    # Dynamo picks its P/D handoff by connector name and refuses names it lacks. Ours is
    # NixlConnector's: the prefill is asked do_remote_decode, its answer is the decode's.
    with contextlib.suppress(ImportError):
        from dynamo.vllm import kv_connector_protocols as dynamo

        dynamo.KV_CONNECTOR_PROTOCOLS.setdefault(CONNECTOR_NAME, dynamo.NixlConnectorProtocol)
