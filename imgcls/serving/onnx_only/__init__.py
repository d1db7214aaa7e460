"""serve.py for ONNX exports without torch or torchvision (the slim serving image: onnxruntime, Pillow,
NumPy, FastAPI/uvicorn): onnxruntime's session and the HTTP glue only. The metadata checks
(model_files.stored_metadata), the eval preprocessing (data.eval_preprocessing) and the rows (the tasks'
tasks/*_rows.py: calibrated `prob`, the energy reject option, multi-label tags) are the ones the torch path
uses; served by the same HTTP app (serving.app) and server (serving.server.GracefulServer)."""
