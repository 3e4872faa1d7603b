"""vLLM KV-connector plugin: prefill->decode KV handoff (vLLM or QAIC decode)."""

CONNECTOR_NAME = "QAICConnector"


def register() -> None:
    """Entry point of the `vllm.general_plugins` group: registers the connector with vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM loads general plugins once per process, but a second call must stay harmless.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "vllm_qaic_connector.connector", "QAICConnector"
    )
