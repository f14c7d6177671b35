"""What serves a variant: rendering the Deployment or LeaderWorkerSet (`render`, `lws`,
`serving_load`), the serving canary (`canary`, `canary_observe`), routing (`routing`, the endpoint
picker). Pure decisions and renderers; may import the other features (artifacts, the autoscaler) and base.
"""
