"""The folder `tandem run` puts first on its ranks' PYTHONPATH, for its `sitecustomize`.

Python imports `sitecustomize` at start-up; this one imports tandem into every rank that Python
runs (`ranks.job_environment`), so that a script that uses torch.distributed alone still gets
what `import tandem` gives it: rank 0's torch store on MASTER_ADDR only, and a word to the
launcher once the rank joined a world (`rendezvous.torch_rendezvous`). Nothing imports this
package as such.
"""
